"""The models benchmarks run on: made once with make-model, then cached under ~/.cache/rollwise.
engine.py and spec_engine.py share the same engine models, so they measure the same weights."""
from __future__ import annotations

from pathlib import Path

from rollwise.make_model import make_model

ENGINE_SIZES = {  # make_model arguments of the engine benchmarks' models
    "bench": dict(family="llama", layers=8, hidden=512, heads=8, kv_heads=4, vocab=8192, seed=0),
    "smoke": dict(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024, seed=0),
}


def cached_model(name: str, override: str | None = None, **make_kwargs) -> str:
    """`override` if given, else ~/.cache/rollwise/NAME, made with make_model(**make_kwargs) if absent."""
    model = override or str(Path.home() / ".cache" / "rollwise" / name)
    if not (Path(model) / "config.json").exists():
        make_model(model, **make_kwargs)
    return model


def engine_model(size: str, override: str | None = None) -> str:
    return cached_model(f"engine-{size}-model", override, **ENGINE_SIZES[size])
