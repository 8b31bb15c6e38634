"""Llama-family decoder (Llama, Qwen2, Qwen3, Qwen3-MoE) over a flat batch of tokens with paged attention.

Parameter names follow Hugging Face's, so `state_dict()` loads from and saves to their safetensors
files unchanged. Differences between the families are flags: Qwen2 has q/k/v biases, Qwen3 has
per-head RMSNorm on q and k, Qwen3-MoE is Qwen3 with sparse experts in place of the MLP (`moe.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rollwise.engine import native
from rollwise.engine.attention import AttentionMetadata, paged_attention
from rollwise.engine.models.linear import Linear
from rollwise.engine.models.moe import Experts, SparseMoE

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    num_experts: int = 0  # Qwen3-MoE: experts per sparse layer, each token's top `experts_per_token`
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()  # the layers with experts; the others have the dense MLP

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        family = cfg.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"unsupported model_type {family!r}; supported: {sorted(FAMILIES)}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        rope = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        if rope is not None and rope.get("rope_type", rope.get("type")) not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported rope_scaling {rope}; supported types: default, linear, llama3")
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) if family == "qwen3_moe" else 0
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        layers = cfg["num_hidden_layers"]
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", family == "qwen2"),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            num_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) if experts else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            moe_layers=tuple(i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0),
        )


class RMSNorm(nn.Module):
    # batch invariance: q-norm's and k-norm's strided inputs copied for the native kernel too (torch's
    # fused RMSNorm rounds a row of 4 heads differently from the same row among more)
    batch_invariant: bool = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant and not x.is_contiguous():
            x = x.contiguous()
        if native.takes(x, self.weight):  # one pass over the rows (inference, fp32 on the CPU)
            return native.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # fused kernel; same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin table for every position up to max_positions, computed in fp32 (as transformers does)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        dim = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        inv_freq = _scale_inv_freq(inv_freq, cfg.rope_scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, [T, 1, D], looked up once per forward."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":  # Llama 3.1: scale low frequencies, keep high ones, blend between
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(mid, blended, scaled)
    return inv_freq


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul (fewer, larger GEMMs); loading splits Hugging Face's three weights in
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kv_cache):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # RoPE in one pass, in place (inference, fp32 on the CPU): q's and k's heads side by side in
        # the projection, or q-norm's and k-norm's fresh outputs
        fused = not self.qk_norm and native.takes(qkv, *rope)
        if fused:
            native.rope_(qkv, 0, self.num_heads + self.num_kv_heads, *rope)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
            fused = native.takes(q, k, *rope)
            if fused:
                native.rope_(q.view(t, -1), 0, self.num_heads, *rope)
                native.rope_(k.view(t, -1), 0, self.num_kv_heads, *rope)
        if not fused:
            q, k = apply_rope(q, k, *rope)
        o = paged_attention(q, k, v, kv_cache[0][self.layer_idx], kv_cache[1][self.layer_idx], meta)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if gate_up.dim() == 2 and native.takes(gate_up):  # one pass instead of silu, then multiply
            return self.down_proj(native.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        if layer_idx in cfg.moe_layers:
            self.mlp = SparseMoE(cfg.num_experts, cfg.experts_per_token, cfg.hidden_size,
                                 cfg.moe_intermediate_size, cfg.norm_topk_prob)
        else:
            self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # no initial values on the meta device (the loader's; see CausalLM)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size) if torch.empty(0).is_meta else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta, kv_cache) -> hidden [T, H]; logits() on selected rows."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # On the meta device (the loader's, which then reads the weights) no math: torch runs a meta op
        # through its Python reference, whose first call imports sympy and torch._dynamo (1.2-1.8 s of
        # every engine's start). The loader makes the rope table once the model's tensors are real.
        meta = torch.empty(0).is_meta
        self.rope = None if meta else RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)
        for name, m in self.named_modules():  # where LoRA adapters keep each linear's deltas
            if isinstance(m, Linear):
                m.lora_key = name

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = self.rope.table(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, rope, meta, kv_cache)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def prepack(self, written: set[int] | None = None) -> None:
        """Refresh the fast-inference copies of the weights (call after loading or updating them);
        `written`: only those of the modules whose weights lie in these storages (their data_ptr)."""
        if written is None:
            for m in self.modules():
                if isinstance(m, (Linear, Experts)):
                    m.repack()
            return
        # storage -> (the parameter on it, the packed modules on it): kept while every storage written
        # is still its parameter's (a sleep that gave the weights back moves them: built again)
        owners = getattr(self, "_owners", None)
        if owners is None or any(ptr not in owners or self.get_parameter(owners[ptr][0]).untyped_storage().data_ptr()
                                 != ptr for ptr in written):
            owners = self._owners = {p.untyped_storage().data_ptr(): (n, []) for n, p in self.named_parameters()}
            for m in self.modules():
                if isinstance(m, (Linear, Experts)):
                    for p in m.parameters(recurse=False):
                        owners[p.untyped_storage().data_ptr()][1].append(m)
        for m in {id(m): m for ptr in written if ptr in owners for m in owners[ptr][1]}.values():
            m.repack()

    def set_batch_invariant(self) -> None:
        """Every linear and expert through the batch-invariant path (linear.py), packed; every RMSNorm
        in the native kernel."""
        for m in self.modules():
            if isinstance(m, (Linear, Experts, RMSNorm)):
                m.batch_invariant = True
        self.prepack()

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Views of the parameters under Hugging Face's names (fused projections split back); writing
        into a view writes the parameter. A tied lm_head appears once, as the embedding."""
        out = {}
        for name, p in self.named_parameters():  # shared (tied) parameters are listed once
            out.update(self._views_of(name, p))
        return out

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """hf_tensors' names and shapes, without building a view."""
        return {k: r[1] for k, r in self._hf_layout().items()}

    def hf_view(self, name: str) -> torch.Tensor:
        """hf_tensors()[name], built alone: a trainer that loads one tensor a call pays for that tensor."""
        for fresh in (False, True):
            pname, shape, stride, offset, pshape = self._hf_layout(fresh)[name]
            p = self.get_parameter(pname)
            if (tuple(p.shape), p.stride()) == pshape:
                return p.as_strided(shape, stride, p.storage_offset() + offset)
        raise ValueError(f"weight {name}: its parameter is {tuple(p.shape)}, not {pshape[0]} (weights given back?)")

    def _hf_layout(self, fresh: bool = False) -> dict[str, tuple]:
        """Each Hugging Face name's place in its parameter: (parameter, shape, stride, offset, the
        parameter's shape and strides). Plain numbers, so it pins no memory; kept unless built while
        a level-2 sleep had emptied the parameters."""
        layout = None if fresh else getattr(self, "_layout", None)
        if layout is None:
            layout = {hf: (name, tuple(v.shape), v.stride(), v.storage_offset() - p.storage_offset(),
                           (tuple(p.shape), p.stride()))
                      for name, p in self.named_parameters() for hf, v in self._views_of(name, p).items()}
            if all(p.numel() for p in self.parameters()):
                self._layout = layout
        return layout

    def _views_of(self, name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
        if ".experts." in name:  # [E, ...]: each expert's linears under its checkpoint names
            return expert_views(name, p)
        c = self.config
        splits = {"qkv_proj": (("q_proj", "k_proj", "v_proj"),
                               [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]),
                  "gate_up_proj": (("gate_proj", "up_proj"), [c.intermediate_size, c.intermediate_size])}
        fused = next((f for f in splits if f".{f}." in name), None)
        if fused is None:
            return {name: p}
        parts, sizes = splits[fused]
        return {name.replace(fused, part): view for part, view in zip(parts, p.split(sizes, dim=0))}

    def moe_layers(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """normal(0, std) for matrices and biases (non-zero, so tests exercise them), ones for norms."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)


def expert_views(name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """`...experts.gate_up_proj` [E, 2I, H] or `...experts.down_proj` [E, H, I] (transformers' layout
    in memory) as the checkpoint's per-expert weights: `...experts.{e}.gate_proj.weight` etc."""
    prefix, kind = name.rsplit(".", 1)
    if kind == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": p[e] for e in range(p.shape[0])}
    gate, up = p.chunk(2, dim=1)
    return {f"{prefix}.{e}.{part}_proj.weight": t[e] for e in range(p.shape[0]) for part, t in (("gate", gate), ("up", up))}
