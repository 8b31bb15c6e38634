"""Load and save Llama-family models in Hugging Face's directory format (config.json + safetensors)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rollwise.engine.models.llama import FAMILIES, CausalLM, ModelConfig, RotaryEmbedding, expert_views

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{model_dir} is not a model directory: no config.json")
    return json.loads(path.read_text())


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a directory's *.safetensors files; ValueError if it has none or one cannot be read
    (a path a client gave: its mistake, not the server's)."""
    try:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir} has no *.safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
    except (OSError, SafetensorError) as e:
        raise ValueError(f"cannot read the weights in {model_dir}: {e}") from e
    return state


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu",
               max_positions: int | None = None, dummy: bool = False) -> CausalLM:
    """The model of a Hugging Face directory with its weights, or with `dummy` zeros in their place
    (the checkpoint not read: its weights come later, by an update)."""
    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    for module in model.modules():  # each parameter made anew, empty (not to_empty: see materialize)
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, materialize(p, TORCH_DTYPES[dtype], device))
    if cfg.tie_word_embeddings:  # each module has a tensor of its own now: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings).to(device)  # fp32 table
    if dummy:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    else:
        load_weights(model, load_state_dict(model_dir))
    return model.eval()


def materialize(p: nn.Parameter, dtype: torch.dtype, device: str) -> nn.Parameter:
    """A meta parameter's empty counterpart. `Module.to_empty` makes it with `empty_like`, which on the
    meta device runs torch's Python reference and imports sympy on its first call: 0.6 s of every
    engine's start."""
    return nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=p.requires_grad)


def load_weights(model: CausalLM, state: dict[str, torch.Tensor], partial: bool = False) -> set[int]:
    """Copy Hugging Face-named weights in place, all-or-nothing: names and shapes are checked before
    anything changes. `partial` allows a subset (a weight update in buckets); a tied lm_head may
    always be absent. Returns the storages written (their data_ptr), for `CausalLM.prepack`."""
    todo = check_weights(model, state, partial)
    targets = {name: model.hf_view(name) for name in todo}  # (views of the weights sent only)
    with torch.no_grad():
        for name, t in todo.items():
            targets[name].copy_(t.to(targets[name].dtype))
    return {t.untyped_storage().data_ptr() for t in targets.values()}


def check_weights(model: CausalLM, state: dict[str, torch.Tensor], partial: bool = False) -> dict[str, torch.Tensor]:
    """The entries of `state` the model takes; ValueError naming the first unknown, missing or
    misshapen weights (nothing is changed). Experts in transformers' in-memory layout (a trainer's
    `experts.gate_up_proj` [E, 2I, H]) are taken as the checkpoint's per-expert weights."""
    targets = model.hf_shapes()
    state = checkpoint_names(state)
    unknown = sorted(set(state) - set(targets) - {"lm_head.weight"})
    if unknown:
        raise ValueError(f"unexpected weights {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
    missing = sorted(set(targets) - set(state))
    if missing and not partial:
        raise ValueError(f"missing weights {missing[:5]}{'...' if len(missing) > 5 else ''}")
    todo = {k: v for k, v in state.items() if k in targets}
    for name, t in todo.items():
        if targets[name] != tuple(t.shape):
            raise ValueError(f"weight {name}: shape {tuple(t.shape)} != model's {targets[name]}")
    return todo


def checkpoint_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors ([E, ...], named `...experts.gate_up_proj` / `...experts.down_proj`) split
    into the per-expert names the checkpoint and `hf_tensors` use; other entries as they are."""
    if not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in state):
        return state
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")) and v.dim() == 3:
            out.update(expert_views(k, v))
        else:
            out[k] = v
    return out


def save_model(model: CausalLM, hf_config: dict, out_dir: str | Path, dtype: str | None = None) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.hf_tensors().items()}
    if dtype:
        state = {k: v.to(TORCH_DTYPES[dtype]) for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(hf_config)
    cfg["architectures"] = [FAMILIES[model.config.family]]
    if dtype:
        cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
