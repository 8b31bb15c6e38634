"""What one engine step costs, as a function of what the step computes. A step is described by
`StepWork`: tokens computed (prefill chunks + decode + drafted tokens), positions that need logits,
sequences in the batch, KV tokens read (each sequence's context, read once per step) and attention
pairs (query tokens x context, the attention FLOPs).

Two kinds of profile, parameters in a TOML file (`rollwise/sim/profiles/`):

- `linear`: seconds = base + a*tokens + b*logits + c*seqs + d*kv_padded + e*attn_padded, fitted by
  `rollwise.sim.fit` from our engine's measured step times on this CPU (its attention gathers and
  computes padded groups, so padding is what costs there).
- `roofline`: derived, not fitted, from the GPU's datasheet and the model's shape, with tensor
  parallelism over `tp` GPUs:
    flops   = 2*P_body*tokens + 2*hidden*vocab*logits + 4*layers*heads*head_dim*attn_pairs
    bytes   = 2*P (bf16 weights, all read once per step) + kv_bytes_per_token*kv_read
    compute = flops / (tp * peak_flops * mfu);  memory = bytes / (tp * hbm_bw * mbu)
    comm    = 2*layers allreduces of tokens*hidden*2 bytes: 2(tp-1)/tp * bytes / allreduce_bw + latency
    step    = overhead + per_seq_overhead*seqs + max(compute, memory) + comm
  Compute and memory traffic overlap (a kernel is bound by one of them); the allreduces do not. P
  comes from the shape (q/k/v/o, gated MLP, embeddings and an untied head); kv_bytes_per_token =
  2 (K and V) * layers * kv_heads * head_dim * 2 bytes. The KV capacity of a replica is what is left
  of `mem_util` of its GPUs' memory after the weights and an activation reserve.
  MoE shapes (`experts`, `experts_per_token`, `moe_intermediate`: Qwen3-MoE's sparse layers, each
  a router and E gated experts, every layer sparse): P_body in the FLOPs counts the k active experts
  (and the router), and a step reads the weights of only the experts its tokens were routed to:
    bytes   = 2*(P - expert params + layers*touched(tokens)*expert size) + kv...
    touched(T) = E*(1 - (1 - k/E)^T), the expected distinct experts T tokens reach when each picks k
  at random, an upper bound (real routing is skewed toward hot experts: fewer distinct ones). So a
  decode step of one sequence reads k experts a layer, and every draft token verified beside it
  reads more, until a batch of ~4E/k tokens reads them all: speculation costs an MoE replica more
  memory traffic per verified token than a dense one. Experts are sharded like the rest (tensor
  parallel over `tp`), so the same allreduces.
Imports no torch.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

PROFILES = Path(__file__).parent / "profiles"


@dataclass(slots=True)
class StepWork:
    tokens: int = 0
    logits: int = 0
    seqs: int = 0
    kv_read: int = 0
    attn_pairs: int = 0
    kv_padded: int = 0  # what our CPU engine gathers: per attention group, sequences x longest context
    attn_padded: int = 0  # and computes: per group, sequences x longest query x longest context


def step_work(entries: list[tuple[int, int, int]]) -> StepWork:
    """entries: (query tokens, context before them, tokens needing logits) per sequence in the step.
    Our engine runs attention in three padded groups (decodes, short queries, prefill chunks)."""
    tokens = logits = kv_read = pairs = 0
    groups = [[0, 0, 0], [0, 0, 0], [0, 0, 0]]  # per group: sequences, longest query, longest context
    for q, ctx, lg in entries:  # (once per sequence per simulated step: kept lean)
        tokens += q
        logits += lg
        kv = ctx + q
        kv_read += kv
        pairs += q * (ctx + (q + 1) // 2)
        g = groups[0 if q == 1 else 1 if q <= 64 else 2]
        g[0] += 1
        if q > g[1]:
            g[1] = q
        if kv > g[2]:
            g[2] = kv
    return StepWork(tokens, logits, len(entries), kv_read, pairs, sum(n * kv for n, _, kv in groups),
                    sum(n * q * kv for n, q, kv in groups))


class LinearCost:
    kind = "linear"
    TERMS = ("base_s", "per_token_s", "per_logit_s", "per_seq_s", "per_kv_token_s", "per_attn_pair_s")

    def __init__(self, coef: dict[str, float], *, name: str = "linear", kv_blocks: int | None = None,
                 block_size: int = 16) -> None:
        unknown = set(coef) - set(self.TERMS)
        if unknown:
            raise ValueError(f"unknown cost terms {sorted(unknown)}; valid: {list(self.TERMS)}")
        self.coef = {t: float(coef.get(t, 0.0)) for t in self.TERMS}
        self.name, self.default_kv_blocks, self.block_size = name, kv_blocks, block_size

    def step_s(self, w: StepWork) -> float:
        c = self.coef
        return (c["base_s"] + c["per_token_s"] * w.tokens + c["per_logit_s"] * w.logits + c["per_seq_s"] * w.seqs
                + c["per_kv_token_s"] * w.kv_padded + c["per_attn_pair_s"] * w.attn_padded)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    intermediate: int = 0  # the dense MLP's (0 in an MoE whose every layer is sparse)
    experts: int = 0  # MoE: routed experts per layer (0: dense)
    experts_per_token: int = 0
    moe_intermediate: int = 0

    def __post_init__(self) -> None:
        bad_moe = bool(self.experts) and not 0 < self.experts_per_token <= self.experts
        if bad_moe or bool(self.experts) != bool(self.moe_intermediate) or not (self.experts or self.intermediate):
            raise ValueError(f"{self.name}: a dense shape needs intermediate; an MoE one experts, "
                             f"0 < experts_per_token <= experts and moe_intermediate")

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    def _body(self, experts: float) -> float:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate if not self.experts else \
            self.hidden * self.experts + experts * self.expert_params  # router + experts
        return self.layers * (attn + mlp)

    @property
    def body_params(self) -> int:
        """Every weight of the decoder layers (what memory holds)."""
        return int(self._body(self.experts))

    @property
    def active_body_params(self) -> int:
        """The decoder layers' weights one token is multiplied by (an MoE's k experts of E)."""
        return int(self._body(self.experts_per_token))

    @property
    def params(self) -> int:
        return self.body_params + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def weight_bytes(self, tokens: int) -> float:
        """bf16 weights a step of `tokens` tokens reads: all of them, or (MoE) the experts it reaches."""
        if not self.experts:
            return 2.0 * self.params
        touched = self.experts * (1 - (1 - self.experts_per_token / self.experts) ** tokens)
        return 2.0 * (self.params - self.layers * (self.experts - touched) * self.expert_params)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    name: str
    peak_tflops: float  # dense bf16
    hbm_tbps: float
    memory_gb: float
    allreduce_gbps: float  # achievable allreduce bus bandwidth over NVLink
    allreduce_latency_us: float
    mfu: float
    mbu: float
    step_overhead_ms: float
    per_seq_overhead_us: float
    mem_util: float = 0.9
    activation_reserve_gb: float = 4.0


class RooflineCost:
    kind = "roofline"

    def __init__(self, gpu: Gpu, model: ModelShape, tp: int, *, name: str = "roofline", block_size: int = 16) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.gpu, self.model, self.tp, self.name, self.block_size = gpu, model, tp, name, block_size

    @property
    def default_kv_blocks(self) -> int:
        g, m = self.gpu, self.model
        per_gpu = g.memory_gb * 1e9 * g.mem_util - 2 * m.params / self.tp - g.activation_reserve_gb * 1e9
        if per_gpu <= 0:
            raise ValueError(f"{m.name} does not fit on {self.tp} x {g.name}")
        return int(per_gpu * self.tp / m.kv_bytes_per_token) // self.block_size

    def parts(self, w: StepWork) -> dict[str, float]:
        g, m, tp = self.gpu, self.model, self.tp
        flops = (2 * m.active_body_params * w.tokens + 2 * m.hidden * m.vocab * w.logits
                 + 4 * m.layers * m.heads * m.head_dim * w.attn_pairs)
        nbytes = m.weight_bytes(w.tokens) + m.kv_bytes_per_token * w.kv_read
        compute = flops / (tp * g.peak_tflops * 1e12 * g.mfu)
        memory = nbytes / (tp * g.hbm_tbps * 1e12 * g.mbu)
        comm = 0.0
        if tp > 1:
            per = 2 * (tp - 1) / tp * w.tokens * m.hidden * 2 / (g.allreduce_gbps * 1e9) + g.allreduce_latency_us * 1e-6
            comm = 2 * m.layers * per
        overhead = g.step_overhead_ms * 1e-3 + g.per_seq_overhead_us * 1e-6 * w.seqs
        return {"compute_s": compute, "memory_s": memory, "comm_s": comm, "overhead_s": overhead}

    def step_s(self, w: StepWork) -> float:
        p = self.parts(w)
        return p["overhead_s"] + max(p["compute_s"], p["memory_s"]) + p["comm_s"]


def load_profile(name_or_path: str) -> LinearCost | RooflineCost:
    """A profile by file name in rollwise/sim/profiles (without .toml) or by path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES / f"{name_or_path}.toml"
    if not name_or_path or not path.is_file():
        raise ValueError(f"unknown cost profile {name_or_path!r}; available: {available_profiles()} or a TOML path")
    d = tomllib.loads(path.read_text())
    kind = d.get("kind")
    if kind == "linear":
        return LinearCost(d["coef"], name=path.stem, kv_blocks=d.get("kv_blocks"), block_size=d.get("block_size", 16))
    if kind == "roofline":
        return RooflineCost(Gpu(**d["gpu"]), ModelShape(**d["model"]), int(d["tp"]), name=path.stem,
                            block_size=d.get("block_size", 16))
    raise ValueError(f"{path}: kind must be 'linear' or 'roofline', got {kind!r}")


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.toml"))
