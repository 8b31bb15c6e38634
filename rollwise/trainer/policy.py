"""The trainable policy: the model directory loaded with transformers (made for training: autograd,
attention masks), token log-probabilities of trajectories in padded micro-batches, and its weights
under Hugging Face names for the inference replicas. Optionally LoRA (`add_lora`, peft's layers):
the weights frozen, low-rank adapters trained, the replicas sent the merged linears. MoE models may
replay the rollout's routing (`routing = "replay"`: each token through the experts it was generated
with, Rollout Routing Replay) or only count where their own router differs (`"record"`). With
`enable_exact` the logprobs' values are the engine's bit for bit (true on-policy, exact.py)."""
from __future__ import annotations

import inspect
import json
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from rollwise.trainer.prefix import decoder_states
from rollwise.types import Trajectory
from rollwise.wire import AdapterWeights


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model")


@dataclass
class Batch:
    """Right-padded trajectories: position t of `targets` is predicted from input positions <= t."""
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1]
    mask: torch.Tensor  # [B, L-1] float: 1 on generated tokens (the loss mask, shifted)
    behaviour_logprobs: torch.Tensor  # [B, L-1] the rollout's sampling logprobs (0 off the mask)
    shared: int = 0  # leading tokens every row has in common, none of them generated
    routing: torch.Tensor | None = None  # [B, L, layers, k] the rollout's experts per token (-1: unknown)
    ref_logprobs: torch.Tensor | None = None  # [B, L-1] under the KL reference, once computed (it never changes)

    @staticmethod
    def of(trajs: list[Trajectory]) -> Batch:
        n = max(len(t.token_ids) for t in trajs)
        ids = torch.zeros(len(trajs), n, dtype=torch.long)
        att = torch.zeros(len(trajs), n, dtype=torch.long)
        mask = torch.zeros(len(trajs), n)
        lp = torch.zeros(len(trajs), n)
        for i, t in enumerate(trajs):
            k = len(t.token_ids)
            ids[i, :k] = torch.tensor(t.token_ids)
            att[i, :k] = 1
            mask[i, :k] = torch.tensor(t.loss_mask, dtype=torch.float)
            lp[i, :k] = torch.tensor(t.logprobs, dtype=torch.float)
        first = min((t.loss_mask.index(1) if 1 in t.loss_mask else len(t.token_ids)) for t in trajs)
        shared = first
        if len(trajs) > 1:
            same = (ids[:, :first] == ids[:1, :first]).all(0)
            shared = int(same.long().cumprod(0).sum())
        return Batch(ids, att, ids[:, 1:], mask[:, 1:], lp[:, 1:], shared, _routing(trajs, n))


def _routing(trajs: list[Trajectory], n: int) -> torch.Tensor | None:
    got = [t.routing() for t in trajs]
    known = [r for r in got if r is not None]
    if not known:
        return None
    out = torch.full((len(trajs), n, *known[0].shape[1:]), -1, dtype=torch.long)
    for i, r in enumerate(got):
        if r is not None:
            out[i, :min(len(r), n)] = torch.from_numpy(r[:n])
    return out


ROUTING_MODES = ("off", "record", "replay")


class PolicyModel:
    def __init__(self, model_dir: str, *, seed: int = 0, threads: int | None = None, load: bool = True) -> None:
        """`load` False: the model built without its weights (uninitialized memory), for a trainer rank
        that takes another's next (data_parallel.py: adopted from shared memory, or broadcast)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from rollwise import mkl
        torch.manual_seed(seed)
        if threads:
            torch.set_num_threads(threads)
        mkl.settle()  # (before its threads share MKL's vector math: its rotary embedding's cos)
        self.model_dir = model_dir
        if load:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        else:
            try:  # (transformers 5; 4.x kept it in modeling_utils)
                from transformers.initialization import no_init_weights
            except ImportError:
                from transformers.modeling_utils import no_init_weights
            with no_init_weights():
                self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
            self.model.tie_weights()  # (as loading does: a tied head is the embedding)
        self.model.config.use_cache = False
        self.model.train()
        self.lora = None  # peft's LoraConfig once `add_lora` has run
        self.checkpointing = False  # gradient checkpointing (`enable_checkpointing`)
        self.exact = None  # the engine's forward for the logprobs' values (`enable_exact`, exact.py)
        self.routing = "off"  # MoE: what to do with a batch's rollout routing (ROUTING_MODES)
        self.head_chunk = 4096  # generated positions through the output head at once (`_head`; 0: all)
        # (token-layers whose own top-k experts differ from the rollout's, token-layers compared)
        self.routing_stats = torch.zeros(2)
        self.expert_load: dict[int, torch.Tensor] = {}  # layer -> tokens the rollout routed to each expert
        self._cache_kw = cache_kw(self.model)

    def logprobs(self, batch: Batch, temperature: float = 1.0, min_shared: int = 32,
                 entropy: list | None = None) -> torch.Tensor:
        """[B, L-1] log p(target) under the current weights at `temperature` (as the engine samples),
        at the generated positions (`batch.mask`); 0 elsewhere. The output head and softmax run only
        there: on agent episodes most positions are prompt and tool output, and the head over the
        vocabulary is the largest cost of a small model's step.

        A prefix the rows share runs once (`decoder_states`: exact, several times cheaper when the
        prompt dominates). With `entropy` (a list), the sampling distribution's entropy at those
        positions, [B, L-1] (0 elsewhere, with its gradient), is appended to it."""
        r = batch.routing if self.routing != "off" else None
        h, off = decoder_states(self.model.get_decoder(), batch, self._cache_kw, min_shared,
                                lambda rows, cols: self._routed(None if r is None else r[rows, cols]))
        lp = self._head(h, batch.targets[:, off:], batch.mask[:, off:], temperature, entropy)
        if off:
            lp = torch.cat([lp.new_zeros(lp.shape[0], off), lp], dim=1)
            if entropy is not None:
                entropy[-1] = torch.cat([lp.new_zeros(lp.shape[0], off), entropy[-1]], dim=1)
        return lp if self.exact is None else self._exact(lp, batch, temperature)

    def enable_checkpointing(self) -> None:
        """Gradient checkpointing: each decoder layer's activations are recomputed in the backward
        instead of kept, so a micro-batch holds its layers' inputs alone, for about a third more
        compute. A shared prefix stays shared (`decoder_states`)."""
        enable_checkpointing(self.model)
        self.checkpointing = True

    def enable_exact(self, adapter: bool = False) -> None:
        """Logprobs whose values are the engine's, bit for bit (batch-invariant kernels), and whose
        gradients are transformers' (true on-policy, exact.py). `adapter`: as replicas that take the
        LoRA adapter alone compute them (the base weights, the adapter's deltas apart); else with
        the adapter merged into the weights."""
        from rollwise.trainer.exact import ExactLogprobs
        self.exact, self.exact_adapter = ExactLogprobs(self.model_dir), adapter

    def _exact(self, lp: torch.Tensor, batch: Batch, temperature: float) -> torch.Tensor:
        adapter = None
        if self.lora is None:
            weights = {k: v.detach() for k, v in self.model.state_dict().items()}
        elif self.exact_adapter:
            weights, adapter = {k: v.detach() for k, v in self.base_state().items()}, self.adapter_weights()
        else:
            weights = self.engine_weights()
        value = self.exact(weights, batch.input_ids, batch.attention_mask, batch.targets, batch.mask, temperature,
                           adapter)
        return value + (lp - lp.detach())  # x - x is 0: the value is exact, the gradient lp's

    def _routed(self, routing: torch.Tensor | None):
        """While inside, each MoE router of the model sees the rollout's experts of the forward's tokens
        (routing [B, T, layers, k], -1 unknown): replayed, or compared only (`self.routing`)."""
        if routing is None:
            return nullcontext()
        if self.routing == "replay" and self.checkpointing:  # (the hooks are gone when a layer replays)
            raise ValueError("routing replay does not work with gradient checkpointing: the layers replayed in "
                             "the backward would route by the trainer's own router")
        flat = routing.reshape(-1, *routing.shape[2:])
        layers = self.model.get_decoder().layers
        gates = [(i, layer.mlp.gate) for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
        return _hooks([gate.register_forward_hook(partial(self._route, flat[:, i], i)) for i, gate in gates])

    def _route(self, rollout: torch.Tensor, layer: int, module, args, output):
        """A router's forward hook: (logits, weights, experts) with the rollout's experts where known,
        each weighted by the router's own probability of it (renormalised as the model does), so
        the router still learns through them."""
        logits, weights, experts = output
        known = (rollout >= 0).all(-1)
        moved = (rollout.sort(-1).values != experts.sort(-1).values).any(-1) & known
        self.routing_stats += torch.tensor([float(moved.sum()), float(known.sum())])
        load = torch.bincount(rollout[known].reshape(-1), minlength=logits.shape[-1])
        self.expert_load[layer] = self.expert_load.get(layer, 0) + load
        if self.routing != "replay" or not bool(moved.any()):
            return output
        experts = torch.where(known[:, None], rollout, experts)
        top = torch.softmax(logits.float(), dim=-1).gather(1, experts)
        if getattr(module, "norm_topk_prob", False):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(weights.dtype), experts

    def _head(self, h: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, temperature: float,
              entropy: list | None = None) -> torch.Tensor:
        """The generated positions' logprobs (and entropies) through the output head, `head_chunk`
        positions at a time beyond that many: each chunk's logits are recomputed in the backward
        instead of kept (verl's chunked entropy; a micro-batch's [positions, vocabulary] logits,
        softmax and their gradients in fp32 are otherwise its largest tensors on a real vocabulary)."""
        sel = mask > 0
        hs, ts, want, head = h[sel], targets[sel], entropy is not None, self.model.get_output_embeddings()
        step = self.head_chunk or max(len(hs), 1)
        run = partial(checkpoint, use_reentrant=False) if len(hs) > step and torch.is_grad_enabled() else _call
        rows = [run(_head_rows, head, hs[a:a + step], ts[a:a + step], temperature, want)
                for a in range(0, max(len(hs), 1), step)]
        out = torch.zeros(targets.shape, dtype=torch.float32)
        out[sel] = torch.cat([lp for lp, _ in rows])
        if want:
            ent = torch.zeros(targets.shape, dtype=torch.float32)
            ent[sel] = torch.cat([e for _, e in rows])
            entropy.append(ent)
        return out

    def add_lora(self, rank: int, alpha: float, targets: str | list[str] = "all-linear", dropout: float = 0.0) -> None:
        """Train low-rank adapters instead of the weights (LoRA, peft's layers put into the model in
        place): every weight is frozen and each targeted linear computes W x + (alpha / rank) B A x,
        with B zero at first, so the model is unchanged until it trains. `targets`: module names, or
        "all-linear" (every linear but the output head). The optimizer holds the adapters alone."""
        from peft import LoraConfig
        if self.lora is not None:
            raise ValueError("the model already has LoRA adapters")
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=dropout)
        inject_lora(self.model, config)  # (targets that match nothing: peft's ValueError)
        self.lora = config

    @contextmanager
    def adapters_off(self):
        """The model without its LoRA adapters while inside (the weights they were trained on); no-op
        without LoRA."""
        layers = [m for _, m in self._lora_layers()] if self.lora is not None else []
        for m in layers:
            m.enable_adapters(False)
        try:
            yield
        finally:
            for m in layers:
                m.enable_adapters(True)

    def _lora_layers(self) -> list[tuple[str, torch.nn.Module]]:
        from peft.tuners.lora import LoraLayer
        return [(n, m) for n, m in self.model.named_modules() if isinstance(m, LoraLayer)]

    @torch.no_grad()
    def engine_weights(self, changed_only: bool = False) -> dict[str, torch.Tensor]:
        """Detached copies under Hugging Face names (what `update_weights` of a replica takes). With
        LoRA each targeted linear's weight is merged (W + its adapter's delta); `changed_only`: those
        alone (the rest is frozen, so a replica that has it needs only these)."""
        if self.lora is None:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        merged = {f"{n}.weight": m.get_base_layer().weight + m.get_delta_weight("default") for n, m in self._lora_layers()}
        if changed_only:
            return merged
        return {k: merged.get(k, v.detach().clone()) for k, v in self.base_state().items()}

    def base_state(self) -> dict[str, torch.Tensor]:
        """The state dict under the model's own names: peft's adapters left out, its base layers renamed."""
        return {k.replace(".base_layer.", "."): v for k, v in self.model.state_dict().items() if "lora_" not in k}

    def save(self, path: str) -> None:
        """The weights in Hugging Face format (LoRA merged in), with the source model's tokenizer files
        beside them, so the directory serves, evaluates and trains as the model it came from did."""
        state = None
        if self.lora is not None:
            state = {**self.base_state(), **self.engine_weights(changed_only=True)}
        self.model.save_pretrained(path, safe_serialization=True, state_dict=state)
        for name in TOKENIZER_FILES:
            if (Path(self.model_dir) / name).is_file():
                shutil.copyfile(Path(self.model_dir) / name, Path(path) / name)

    def save_adapter(self, path: str, base_model: str) -> None:
        """The LoRA adapter as peft saves one (`adapter_config.json`, `adapter_model.safetensors`):
        `peft.PeftModel.from_pretrained(base, path)`, or a server that takes LoRA adapters, on
        `base_model` (the weights the adapter was trained on: the warm start, if any)."""
        from safetensors.torch import save_file
        Path(path).mkdir(parents=True, exist_ok=True)
        adapter = self.adapter_weights(base_model)
        save_file(adapter.tensors, str(Path(path) / "adapter_model.safetensors"))
        (Path(path) / "adapter_config.json").write_text(json.dumps(adapter.config, indent=2))

    @torch.no_grad()
    def adapter_weights(self, base_model: str = "") -> AdapterWeights:
        """The LoRA adapter as peft saves it: its config (JSON-ready) and tensors under peft's names
        (copies), what a replica serves on the base weights (`lora_sync = "adapter"`)."""
        from peft import get_peft_model_state_dict
        state = get_peft_model_state_dict(self.model)
        config = json.loads(json.dumps({**self.lora.to_dict(), "base_model_name_or_path": str(base_model),
                                        "task_type": "CAUSAL_LM"},
                                       default=lambda x: sorted(x) if isinstance(x, (set, frozenset)) else str(x)))
        return AdapterWeights(config, {f"base_model.model.{k}": v.detach().clone().contiguous() for k, v in state.items()})

    def base_weights(self) -> dict[str, torch.Tensor]:
        """The weights without the LoRA adapters (what they train on), under Hugging Face names."""
        return {k: v.detach().clone() for k, v in self.base_state().items()}

    def parameters(self):
        """The trainable parameters (the adapters alone, with LoRA)."""
        return [p for p in self.model.parameters() if p.requires_grad]


def _call(f, *args):
    return f(*args)


def _head_rows(head, hs: torch.Tensor, ts: torch.Tensor, temperature: float, entropy: bool):
    """Rows' logprob of their target (and the distribution's entropy, else None) at `temperature`."""
    logits = head(hs).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, ts.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1) if entropy else None


def inject_lora(model, config) -> None:
    """peft's LoRA layers of `config` put into `model` in place; every other weight frozen."""
    from peft import inject_adapter_in_model
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def enable_checkpointing(model) -> None:
    """transformers' gradient checkpointing of every decoder layer, non-reentrant (gradients reach the
    shared prefix's KV, which the layers read from the cache, not from their arguments), the cache
    passed on: `decoder_states`' read-only prefix layers give a replay the keys its forward had."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # (the name since transformers 5.25)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for m in model.modules():
        if hasattr(m, "_can_checkpoint_with_cache"):
            m._can_checkpoint_with_cache = True


def cache_kw(model) -> str:
    """The name of a model's forward's KV-cache argument (transformers 5.24 renamed past_key_values to cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextmanager
def _hooks(handles):
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def micro_batches(trajs: list[Trajectory], max_tokens: int) -> list[list[Trajectory]]:
    """Groups of trajectories whose padded size (count x longest) stays under `max_tokens`;
    sorted by length so padding is small."""
    out: list[list[Trajectory]] = []
    cur: list[Trajectory] = []
    for t in sorted(trajs, key=lambda t: len(t.token_ids)):
        if cur and (len(cur) + 1) * len(t.token_ids) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(t)
    if cur:
        out.append(cur)
    return out
