"""Sleep mode (rollwise/engine/sleep.py): an idle engine gives its KV pool (level 1) and its weights
(level 2) back to the OS, refuses requests meanwhile, and once woken (and at level 2 given every
weight again) serves the same tokens as before."""
from __future__ import annotations

import os

import pytest

from rollwise.config import EngineConfig
from rollwise.engine.llm import LLM
from rollwise.engine.llm_engine import LLMEngine
from rollwise.engine.models.loader import load_state_dict
from rollwise.engine.sleep import EngineAsleep
from rollwise.types import SamplingParams, WeightsNotHeld

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [40, 41, 42]]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _touch(pool) -> None:
    for cache in pool:
        cache.add_(0.0)


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_level_one_gives_the_kv_pool_back_and_wakes_to_the_same_tokens(model_dir):
    llm = LLM(model_dir, kv_cache_gb=0.25)
    before = _greedy(llm)
    assert llm.generate(PROMPTS[0], GREEDY)[0].num_cached_tokens > 0  # its prefix is cached
    rss = _rss_mib()
    _touch(llm.engine.runner.kv_cache)  # every page of the pool written, as a long run's would be
    assert _rss_mib() - rss > 0.8 * 256  # (the OS commits its pages as they are first written)
    rss = _rss_mib()
    llm.sleep(1)
    assert rss - _rss_mib() > 0.8 * 256  # the pool's 256 MiB went back to the OS
    assert llm.engine.is_sleeping and llm.metrics()["is_sleeping"] == 1.0
    with pytest.raises(EngineAsleep, match="wake it up"):
        llm.generate(PROMPTS[1], GREEDY)
    llm.wake_up()
    assert not llm.engine.is_sleeping and llm.metrics()["is_sleeping"] == 0.0
    assert not any(c.any() for c in llm.engine.runner.kv_cache)  # a fresh, zeroed pool
    again = llm.generate(PROMPTS[0], GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == before[0]  # what was cached is forgotten
    assert _greedy(llm) == before
    llm.engine.scheduler.check_integrity()


def test_only_an_idle_engine_sleeps_and_bad_levels_and_tags_are_named(model_dir):
    eng = LLMEngine(EngineConfig(model=model_dir, kv_cache_gb=0.05))
    with pytest.raises(ValueError, match="level must be 1"):
        eng.sleep(3)
    with pytest.raises(ValueError, match=r"\['weights', 'kv_cache'\]"):
        eng.release_memory(["gpu"])
    eng.add_request(PROMPTS[1], GREEDY, request_id="r")
    with pytest.raises(ValueError, match="in flight.*'r'"):
        eng.sleep(1)
    assert not eng.is_sleeping  # nothing was given back: the request still runs
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    assert len(outs[-1].token_ids) == 12
    eng.release_memory(["kv_cache"])
    eng.wake_up(["weights"])  # not asleep: nothing changes
    assert eng.asleep == {"kv_cache"}
    eng.wake_up("kv_cache")
    assert not eng.is_sleeping


@pytest.mark.parametrize("family,invariant", [("qwen3", False), ("qwen3_moe", True)])
def test_level_two_serves_again_once_every_weight_is_loaded(model_dirs, family, invariant):
    d = model_dirs[family]
    llm = LLM(d, kv_cache_gb=0.05, keep_weight_versions=2, batch_invariant=invariant,
              enable_return_routed_experts=family == "qwen3_moe")
    before = _greedy(llm)
    state = load_state_dict(d)
    assert llm.update_weights(state) == 1 and llm.engine._loaded == [0, 1]
    llm.sleep(2)
    assert llm.engine._loaded == [1] and all(p.numel() == 0 for p in llm.engine.runner.model.parameters())
    with pytest.raises(EngineAsleep, match="wake_up"):
        llm.update_weights(state)
    llm.wake_up(["weights"])
    with pytest.raises(EngineAsleep, match="kv_cache"):
        llm.generate(PROMPTS[1], GREEDY)
    llm.wake_up()
    with pytest.raises(EngineAsleep, match="level-2"):  # woken weights have no values yet
        llm.generate(PROMPTS[1], GREEDY)
    names = sorted(state)  # the weights in two buckets, as a trainer sends them: none served before the last
    llm.update_weights({n: state[n] for n in names[:3]})
    with pytest.raises(EngineAsleep, match=f"{len(names) - 3} not loaded yet"):
        llm.generate(PROMPTS[1], GREEDY)
    assert llm.update_weights({n: state[n] for n in names[3:]}) == 3 and llm.engine._loaded == [3]  # (in place)
    assert _greedy(llm) == before and not llm.engine.weights_lost
    with pytest.raises(WeightsNotHeld):  # the versions before the sleep are gone
        llm.engine.add_request(PROMPTS[1], GREEDY, policy_version=0)
    if family == "qwen3_moe":
        out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=4, return_routed_experts=True))[0]
        assert out.routed_experts.shape == (len(PROMPTS[1]) + 3, 2, 2) and (out.routed_experts >= 0).all()


_CYCLES = """
import json, sys, threading
if sys.argv[2] == "settled":  # (first thing, as rollwise's command line does)
    from rollwise.engine import allocator
    assert allocator.settle()
from rollwise.engine.llm import LLM
from rollwise.engine.models.loader import load_state_dict
from rollwise.make_model import make_model
from rollwise.types import SamplingParams

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

d = make_model(sys.argv[1], family="qwen3", layers=4, hidden=512, heads=8, kv_heads=4, vocab=1024, seed=5)
llm = LLM(str(d), kv_cache_gb=0.01)
size = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters()) / 2**20
state = load_state_dict(str(d))
greedy = lambda: [o.token_ids for o in llm.generate([[5, 6, 7, 8] * 8], SamplingParams(max_tokens=12, temperature=0))]
before = greedy()
awake, asleep = [], []

def cycle():
    awake.append(rss())
    llm.sleep(2)
    asleep.append(rss())
    llm.wake_up()
    llm.update_weights(state)
for _ in range(4):
    t = threading.Thread(target=cycle)
    t.start()
    t.join()
print(json.dumps({"size": size, "awake": awake, "asleep": asleep, "same": greedy() == before}))
"""


@pytest.mark.parametrize("malloc", ["glibc", "settled"])
def test_level_two_gives_the_weights_memory_back_cycle_after_cycle(tmp_path, malloc):
    """A 12M-parameter model (48 MB, and its packed copies) through four RL-like cycles, each woken
    and loaded on a thread of its own: each sleep gives the weights' memory back to the OS, and the
    process does not grow from cycle to cycle (glibc's arenas would keep what a wake allocated),
    under glibc's defaults and set up as `rollwise serve` sets it (rollwise.engine.allocator). In a
    process of its own: other tests' leftovers in a shared heap pin pages a trim cannot give back."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _CYCLES, str(tmp_path / "m"), malloc], capture_output=True,
                         text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    size, awake, asleep = r["size"], r["awake"], r["asleep"]
    assert size > 40 and all(a - b > 0.9 * size for a, b in zip(awake, asleep)), r
    # (without the allocator's trim a cycle grew by 64-144 MB)
    assert max(awake[1:]) - awake[1] < 0.5 * size and max(asleep[1:]) - asleep[1] < 0.5 * size, r
    assert r["same"]


def test_dummy_weights_serve_once_every_weight_is_loaded(model_dir):
    """load_format "dummy" (vLLM's and SGLang's, as verl starts its rollout engines): no checkpoint read,
    nothing served until update_weights has brought every weight (here in two buckets); then the same
    tokens as the checkpoint's."""
    want = [o.token_ids for o in LLM(model_dir).generate(PROMPTS, GREEDY)]
    llm = LLM(model_dir, load_format="dummy")
    with pytest.raises(EngineAsleep, match="load_format 'dummy'"):
        llm.generate(PROMPTS, GREEDY)
    state = load_state_dict(model_dir)
    names = sorted(state)
    llm.update_weights({n: state[n] for n in names[:4]})
    with pytest.raises(EngineAsleep, match=f"{len(names) - 4} not loaded yet"):
        llm.generate(PROMPTS, GREEDY)
    llm.update_weights({n: state[n] for n in names[4:]})
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(model=model_dir, load_format="gguf")
