from __future__ import annotations

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

import pytest  # noqa: E402

from rollwise.make_model import make_model  # noqa: E402

# std 0.1 gives peaked enough logits that greedy ties (where fp32 noise could flip a token) are rare
FAMILIES = {
    "llama": dict(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024, std=0.1),
    "qwen2": dict(family="qwen2", layers=2, hidden=64, heads=4, kv_heads=1, vocab=1024, std=0.1, seed=1),
    "qwen3": dict(family="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024, std=0.1, seed=2,
                  tie=True, head_dim=32),
    "qwen3_moe": dict(family="qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024, std=0.1, seed=3,
                      experts=8, experts_per_token=2, moe_intermediate=48),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: str(make_model(root / name, **kw)) for name, kw in FAMILIES.items()}


@pytest.fixture(scope="session")
def model_dir(model_dirs) -> str:
    return model_dirs["qwen3"]


@pytest.fixture(scope="session")
def rm_dir(model_dir, tmp_path_factory) -> str:
    """A reward model on the test model's weights (Qwen3ForSequenceClassification, a random score head)."""
    from rollwise.make_model import make_reward_model
    return str(make_reward_model(model_dir, tmp_path_factory.mktemp("rm")))


@pytest.fixture(autouse=True, scope="module")
def _free_engines():
    """Engines a module's tests made (each holds its KV pool's used pages, up to 1 GB by default) freed
    before the next module's, reference cycles included: the suite runs in one process."""
    yield
    import gc
    gc.collect()
