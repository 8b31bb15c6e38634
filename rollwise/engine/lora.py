"""LoRA adapters served beside the base weights (multi-LoRA): each request names one or none, and a
batch mixes them freely. An adapter is peft's format (`adapter_config.json` + `adapter_model.safetensors`:
`...q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]); each targeted Hugging Face linear maps
to a slice of one of ours (q, k and v are one fused projection, gate and up another), and its delta
`x A^T B^T * alpha / r` (alpha / sqrt(r) with rsLoRA) is added to that slice of the output for the
rows of the requests that named the adapter. The base weights never change, so every weights
version serves every adapter, and the prefix cache keys blocks by adapter (their KV differs).
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from rollwise.engine.models import linear  # (linear imports this module: names looked up at call time)

_local = threading.local()  # this thread's forward: [(rows, adapter)], set by the model runner


def plan() -> list | None:
    return getattr(_local, "plan", None)


def set_plan(p: list | None) -> None:
    _local.plan = p


def adapter_name(engine, request) -> str:
    """The name of a vLLM LoRARequest's adapter (anything with `lora_name` and `lora_path`), loaded into
    the LLMEngine from its path if no adapter has that name yet."""
    name, path = getattr(request, "lora_name", None), getattr(request, "lora_path", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"lora_request must be a LoRARequest (lora_name, lora_path), got {request!r}")
    if name not in engine.loras:
        if not path:
            raise ValueError(f"LoRA adapter {name!r} is not loaded and its request gives no lora_path")
        engine.add_lora(name, str(path))
    return name


class Adapter:
    """One loaded adapter: per linear of ours (its module name), [(out_lo, out_hi, A [r, in], B [out, r] scaled,
    (A, B) packed for the batch-invariant path or None)]."""

    def __init__(self, name: str, parts: dict[str, list], rank: int, uid: int) -> None:
        self.name, self.parts, self.rank, self.uid = name, parts, rank, uid


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    p = Path(path)
    if not (p / "adapter_config.json").is_file():
        raise ValueError(f"{path} is not a LoRA adapter: no adapter_config.json")
    files = sorted(p.glob("adapter_model*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no adapter_model.safetensors")
    state: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            state.update(load_file(str(f)))
        return json.loads((p / "adapter_config.json").read_text()), state
    except (OSError, SafetensorError) as e:
        raise ValueError(f"cannot read the LoRA adapter in {path}: {e}") from e


def build(model, name: str, config: dict, state: dict[str, torch.Tensor], uid: int, max_rank: int) -> Adapter:
    """The adapter's deltas placed on the model's linears; ValueError for what cannot be served (a
    module the engine does not adapt, a rank above max_rank, shapes that do not fit), naming it."""
    c = model.config
    r = int(config.get("r", 0))
    if not 1 <= r <= max_rank:
        raise ValueError(f"adapter {name!r}: rank {r} is outside 1..max_lora_rank ({max_rank})")
    if config.get("use_dora"):
        raise ValueError(f"adapter {name!r}: DoRA adapters are not served")
    alpha = float(config.get("lora_alpha", r))
    scale = alpha / (r ** 0.5 if config.get("use_rslora") else r)
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    slots = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, q + kv), "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
             "o_proj": ("o_proj", 0, c.hidden_size), "gate_proj": ("gate_up_proj", 0, inter),
             "up_proj": ("gate_up_proj", inter, 2 * inter), "down_proj": ("down_proj", 0, c.hidden_size)}
    other = sorted(k for k in state if ".lora_A." not in k and ".lora_B." not in k)
    if other or config.get("modules_to_save"):
        raise ValueError(f"adapter {name!r}: only lora_A / lora_B weights are served, not "
                         f"{other[:3] or config.get('modules_to_save')}")
    linears = dict(model.named_modules())
    parts: dict[str, list] = {}
    for key, a in state.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = state.get(key.replace(".lora_A.", ".lora_B."))
        parent, _, leaf = module.rpartition(".")
        if b is None or leaf not in slots or f"{parent}.{slots[leaf][0]}" not in linears:
            raise ValueError(f"adapter {name!r}: cannot serve {module} (adapted linears: {sorted(slots)} of the "
                             "decoder layers' attention and dense MLPs)")
        fused, lo, hi = slots[leaf]
        target = linears[f"{parent}.{fused}"]
        if tuple(a.shape) != (r, target.in_features) or tuple(b.shape) != (hi - lo, r):
            raise ValueError(f"adapter {name!r}: {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; the model "
                             f"needs ({r}, {target.in_features}) and ({hi - lo}, {r})")
        w = target.weight
        a, b = a.to(w.device, w.dtype).contiguous(), (b.float() * scale).to(w.device, w.dtype).contiguous()
        packed = (linear.pack(a), linear.pack(b)) if target.batch_invariant else None  # its linear's path
        parts.setdefault(f"{parent}.{fused}", []).append((lo, hi, a, b, packed))
    if not parts:
        raise ValueError(f"adapter {name!r} has no lora_A / lora_B weights")
    return Adapter(name, parts, r, uid)


def add_deltas(key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y (the linear `key`'s output for rows x) plus the deltas of the adapters the forward's plan
    gives those rows."""
    for rows, adapter in _local.plan:
        for lo, hi, a, b, packed in adapter.parts.get(key, ()):
            if packed is not None:
                y[rows, lo:hi] += linear.packed_linear(linear.packed_linear(x[rows], packed[0]), packed[1])
            else:
                y[rows, lo:hi] += (x[rows] @ a.t()) @ b.t()
    return y
