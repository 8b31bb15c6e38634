import asyncio
import random
from pathlib import Path

import pytest

from rollwise.sim.clock import VirtualClockLoop, run
from rollwise.sim.cost import LinearCost, StepWork, load_profile, step_work
from rollwise.sim.fit import fit
from rollwise.sim.replica import SimReplica
from rollwise.sim.run import SimConfig, simulate
from rollwise.sim.workload import SimTrajectory, mooncake_step, synthetic_scale
from rollwise.types import GenerateRequest, SamplingParams

COST = LinearCost({"base_s": 1e-3, "per_token_s": 1e-5, "per_seq_s": 1e-4, "per_kv_token_s": 1e-7})


def _req(prompt, out, tid=None, group=None):
    return GenerateRequest(prompt_token_ids=prompt, params=SamplingParams(max_tokens=len(out), ignore_eos=True),
                           forced_output=out, trajectory_id=tid, group_id=group)


def test_virtual_clock_jumps_to_timers_and_reports_a_deadlock():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.gather(asyncio.sleep(3600), asyncio.sleep(5))
        return loop.time()
    assert run(main()) == pytest.approx(3600)

    async def stuck():
        await asyncio.get_running_loop().create_future()
    with pytest.raises(RuntimeError, match="deadlock"):
        run(stuck())
    assert isinstance(VirtualClockLoop().time(), float)


def test_roofline_is_derived_from_the_shape_and_datasheet():
    c = load_profile("h100-qwen3-32b-tp4")
    assert c.model.params == pytest.approx(32.8e9, rel=0.01)  # Qwen3-32B
    assert c.model.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    one = c.parts(StepWork(tokens=1, logits=1, seqs=1, kv_read=4000, attn_pairs=4000))
    assert one["memory_s"] > 10 * one["compute_s"]  # decode at batch 1 reads weights: memory-bound
    big = c.parts(StepWork(tokens=8192, logits=1, seqs=1, kv_read=8192, attn_pairs=8192 * 4096))
    assert big["compute_s"] > big["memory_s"]  # a long prefill chunk is compute-bound
    assert load_profile("h200-qwen3-32b-tp4").default_kv_blocks > 1.5 * c.default_kv_blocks  # 141 vs 80 GB
    for bad in ("tpu-v9", "", "."):  # (the empty name and a directory are no profile file either)
        with pytest.raises(ValueError, match="available"):
            load_profile(bad)


def test_moe_roofline_reads_only_the_experts_its_tokens_reach():
    c = load_profile("h100-qwen3-30b-a3b-tp2")
    m = c.model
    assert m.params == pytest.approx(30.5e9, rel=0.01)  # Qwen3-30B-A3B: 30.5B parameters, 3.3B active
    assert m.active_body_params + 2 * m.vocab * m.hidden == pytest.approx(3.35e9, rel=0.01)
    rest = 2 * (m.params - m.layers * m.experts * m.expert_params)  # attention, routers, embeddings, head
    # one token reaches k experts a layer; a long prefill chunk all of them
    assert m.weight_bytes(1) == pytest.approx(rest + 2 * m.layers * m.experts_per_token * m.expert_params)
    assert m.weight_bytes(8192) == pytest.approx(2 * m.params)
    assert m.weight_bytes(1) < m.weight_bytes(2) < m.weight_bytes(16) < 0.99 * m.weight_bytes(256)
    # verifying 4 drafted tokens beside a decode: the MoE reads ~1.6x the bytes, the dense model the same
    dense = load_profile("h100-qwen3-32b-tp4")
    for cost, lo, hi in ((c, 1.4, 2.0), (dense, 1.0, 1.05)):
        one, five = (cost.step_s(step_work([(q, 4096, q)])) for q in (1, 5))
        assert lo < five / one < hi
    assert c.default_kv_blocks * c.block_size > 700_000  # 2 x 80 GB less 61 GB of weights
    example = SimConfig.from_toml(Path(__file__).parents[2] / "examples" / "sim-war-h100-moe.toml")
    assert (example.profile, example.replicas) == ("h100-qwen3-30b-a3b-tp2", 8)  # 16 GPUs, as the dense sweep
    with pytest.raises(ValueError, match="experts_per_token"):
        type(m)(name="bad", layers=1, hidden=8, heads=1, kv_heads=1, head_dim=8, vocab=8, experts=4,
                experts_per_token=8, moe_intermediate=8)


def test_fit_recovers_a_known_linear_cost():
    rng = random.Random(0)
    truth = LinearCost({"base_s": 2e-3, "per_token_s": 3e-5, "per_seq_s": 1e-4, "per_kv_token_s": 2e-7,
                        "per_attn_pair_s": 1e-8})
    samples = []
    for _ in range(300):
        w = step_work([(rng.choice([1, 1, 5, 300]), rng.randrange(2000), rng.choice([0, 1])) for _ in range(rng.randint(1, 16))])
        samples.append((w, truth.step_s(w)))
    got = fit(samples)
    for k, v in truth.coef.items():
        assert got.coef[k] == pytest.approx(v, rel=1e-3, abs=1e-12)


def test_fit_in_seconds_keeps_the_total_where_a_relative_fit_underpredicts_long_steps():
    # the engine's steps are not exactly linear (here long prefills cost superlinearly): a fit on
    # relative error serves the many short steps and under-predicts the few long ones, so the sum of
    # step times (a makespan) comes out low; a fit in seconds keeps the total
    rng = random.Random(1)
    samples = []
    for _ in range(400):
        w = step_work([(rng.choice([1, 1, 1, 1, 512]), rng.randrange(4000), 1) for _ in range(rng.randint(1, 16))])
        samples.append((w, 1e-3 + 2e-7 * w.kv_padded + 5e-9 * w.tokens ** 2))
    total = sum(dt for _, dt in samples)
    pred = {loss: sum(fit(samples, loss).step_s(w) for w, _ in samples) for loss in ("seconds", "relative")}
    assert pred["seconds"] == pytest.approx(total, rel=0.03)
    assert pred["relative"] < 0.9 * total
    with pytest.raises(ValueError, match="seconds"):
        fit(samples, "mse")


async def _serve(replica, reqs, gaps=None):
    loop = asyncio.get_running_loop()

    async def one(i, r):
        await asyncio.sleep(gaps[i] if gaps else 0)
        out = await replica.generate(r)
        return out, loop.time()
    res = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    replica.close()
    return res


def test_decode_stretches_equal_single_steps_and_outputs_are_the_forced_tokens():
    rng = random.Random(1)
    reqs = [_req([rng.randrange(1000) for _ in range(rng.randint(20, 200))], [rng.randrange(1000) for _ in range(rng.randint(5, 80))])
            for _ in range(12)]
    gaps = [rng.uniform(0, 0.05) for _ in reqs]
    fast = run(_serve(SimReplica("a", COST, num_kv_blocks=4096), reqs, gaps))
    slow_r = SimReplica("b", COST, num_kv_blocks=4096)
    slow_r._stretch = lambda batch: 1  # every step simulated on its own
    slow = run(_serve(slow_r, reqs, gaps))
    for (o1, t1), (o2, t2), r in zip(fast, slow, reqs):
        assert o1.token_ids == o2.token_ids == r.forced_output
        assert t1 == pytest.approx(t2, rel=0.02)


def test_step_work_counts_logits_as_the_engine_does():
    """A prefill chunk that ends a prompt needs one logit (the engine's step traces count so), a
    decode with k drafts 1 + k: counting one per prefill token overstated recomputation's cost."""
    rep = SimReplica("r", LinearCost({"base_s": 1e-3, "per_logit_s": 1e-3}), num_kv_blocks=256,
                     max_num_batched_tokens=64)
    works = []
    work = rep._work
    rep._work = lambda batch, drafts: works.append(work(batch, drafts)) or works[-1]
    run(_serve(rep, [_req(list(range(100)), [7] * 5)]))
    assert [w.tokens for w in works[:2]] == [64, 36]  # two prefill chunks, then decode steps (a stretch)
    assert [w.logits for w in works] == [0] + [1] * (len(works) - 1)  # the last chunk's one, one per decode


def test_prefix_reuse_eviction_and_preemption():
    base = list(range(100, 164))

    async def turns(replica):
        a = await replica.generate(_req(base, [1] * 20, tid="t"))
        b = await replica.generate(_req(base + [1] * 20 + [2] * 8, [3] * 4, tid="t"))
        replica.close()
        return a, b
    rep = SimReplica("r", COST, num_kv_blocks=64, max_num_batched_tokens=32)
    a, b = run(turns(rep))
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 80  # 64 + 16 of the 84 computed tokens
    # a KV pool smaller than the batch's working set: preemption and recompute, every output intact
    rep = SimReplica("small", COST, num_kv_blocks=24)
    reqs = [_req([i] * 100, [i + 1] * 60) for i in range(6)]
    res = run(_serve(rep, reqs))
    assert [o.token_ids for o, _ in res] == [r.forced_output for r in reqs]
    assert rep.stats["preemptions"] > 0 and rep.stats["prefill_tokens"] > 600


@pytest.mark.parametrize("budget", [1024, 40])
def test_siblings_arriving_together_compute_their_prompt_once_as_in_the_engine(budget):
    """The engine's rule (tests/engine: the same figures): a group's samples queued at once wait for
    the first one's prompt blocks instead of computing them beside it."""
    p = list(range(100, 213))  # 113 tokens: 7 full blocks of 16
    rep = SimReplica("r", COST, num_kv_blocks=256, max_num_batched_tokens=budget)
    res = run(_serve(rep, [_req(p, [5 + i] * 6) for i in range(8)]))
    assert [o.num_cached_tokens for o, _ in res] == [0] + [112] * 7
    assert rep.stats["prefill_tokens"] == 113 + 7 * 1
    assert [o.token_ids for o, _ in res] == [[5 + i] * 6 for i in range(8)]
    # switched off (SimConfig.share_computing_prefix, an A/B baseline): at budget 1,024 all 8 fit in
    # the first step and each computes the prompt; at 40 the second starts in the first's last chunk
    off = SimReplica("r", COST, num_kv_blocks=256, max_num_batched_tokens=budget, share_computing_prefix=False)
    res = run(_serve(off, [_req(p, [5 + i] * 6) for i in range(8)]))
    assert [o.num_cached_tokens for o, _ in res] == ([0] * 8 if budget > 113 * 8 else [0, 80] + [112] * 6)
    assert [o.token_ids for o, _ in res] == [[5 + i] * 6 for i in range(8)]


def test_speculation_uses_the_real_suffix_cache_and_changes_nothing_but_time():
    text = [random.Random(2).randrange(50) for _ in range(40)]
    reqs = [_req(text * 2, (text * 3)[:100], group="g") for _ in range(4)]
    off, on = SimReplica("off", COST, spec="off", num_kv_blocks=512), SimReplica("on", COST, spec="always", num_kv_blocks=512)
    r_off, r_on = run(_serve(off, reqs)), run(_serve(on, reqs))
    assert [o.token_ids for o, _ in r_off] == [o.token_ids for o, _ in r_on]
    assert on.stats["accepted_tokens"] > 200 and on.stats["steps"] < off.stats["steps"] / 3
    assert max(t for _, t in r_on) < max(t for _, t in r_off)


def test_simulated_step_does_equal_work_under_every_config_and_is_deterministic():
    step = synthetic_scale(48, seed=3, context=(64, 256), turns=(2, 4), response=(8, 32), obs=(8, 64))
    cfg = SimConfig(profile="h100-qwen3-8b-tp1", replicas=2, kv_blocks=2000)
    res = {c: simulate(cfg, c, step) for c in ("baseline", "war", "rollwise")}
    work = {(r["turns"], r["generated_tokens"]) for r in res.values()}
    assert work == {(sum(len(t.turns) for t in step), sum(t.decode_tokens for t in step))}
    again = simulate(cfg, "rollwise", step)
    assert again["makespan_s"] == res["rollwise"]["makespan_s"]
    assert all(r["truncated"] == 0 for r in res.values())


def test_the_critical_path_is_the_last_trajectory_split_into_arrival_tools_and_generation():
    from rollwise.router.workload import ReplayTrajectory, run_step

    class Gen:  # a turn takes 0.1 s per token to generate
        async def generate(self, req):
            await asyncio.sleep(0.1 * len(req.forced_output))

    ts = [ReplayTrajectory("a", "g", [([1], [2] * 5), ([1, 2], [3] * 20)], [4.0]),  # 0.5 + 4 + 2 = 6.5 s
          ReplayTrajectory("b", "g", [([1], [2] * 10), ([1, 2], [3] * 10)], [3.0], arrival_s=2.0),  # 2 + 1 + 3 + 1
          ReplayTrajectory("c", "h", [([1], [2] * 30)])]  # 3 s
    r = run(run_step(Gen(), ts))
    assert r["makespan_s"] == pytest.approx(7.0)
    last = r["last"]
    assert last["trajectory_id"] == "b" and last["turns"] == 2
    assert (last["arrival_s"], last["tool_s"]) == (2.0, 3.0) and last["generate_s"] == pytest.approx(2.0)
    sim = simulate(SimConfig(profile="cpu-fitted", replicas=1, kv_blocks=256), "rollwise", ts)
    s = sim["last"]
    assert s["arrival_s"] + s["tool_s"] + s["generate_s"] == pytest.approx(sim["makespan_s"])


def test_spec_alpha_reaches_the_simulated_suffix_caches():
    from rollwise.sim.run import make_replicas
    alpha = {(a, mode): make_replicas(SimConfig(replicas=1, spec_alpha=a), mode)[0].cache.alpha
             for a in (None, 1.0) for mode in ("adaptive", "threshold")}
    assert alpha == {(None, "adaptive"): 2.0, (None, "threshold"): 1.0, (1.0, "adaptive"): 1.0, (1.0, "threshold"): 1.0}


def test_tool_scale_scales_every_tool_latency_and_nothing_else():
    from rollwise.sim.workload import war_step
    pool = [[[([1, 2, 3], [4, 5, 6]), ([7, 8], [9])], [([3, 2], [1, 1, 1]), ([5], [])]]]  # one task, two trials
    kw = dict(context=(64, 128), turns=(3, 6), obs_median=16)
    one, half, none = (war_step(pool, 2, 3, tool_scale=s, **kw) for s in (1.0, 0.5, 0.0))
    assert [t.tokens for t in one] == [t.tokens for t in half] == [t.tokens for t in none]
    assert [t.turns for t in one] == [t.turns for t in none]
    lat = [x for t in one for x in t.tool_latency]
    assert lat and all(0.2 <= x <= 10.0 for x in lat)
    assert [x for t in half for x in t.tool_latency] == pytest.approx([x / 2 for x in lat])
    assert all(x == 0.0 for t in none for x in t.tool_latency)
    with pytest.raises(ValueError, match="tool_scale"):
        SimConfig(tool_scale=-1.0)
    with pytest.raises(ValueError, match="tool_latency"):
        SimConfig(tool_latency=(0.0, 1.0))


def test_sandbox_ttl_truncates_a_trajectory_that_waited_too_long():
    t = SimTrajectory("t", "g", list(range(100, 400)), [(100, 200), (250, 300)], [1.0])
    cfg = SimConfig(profile="cpu-fitted", replicas=1, kv_blocks=256, sandbox_ttl_s=1e-6)
    r = simulate(cfg, "baseline", [t])
    assert r["truncated"] == 1 and r["turns"] == 1


def test_config_errors_name_the_valid_options(tmp_path):
    with pytest.raises(ValueError, match="valid"):
        SimConfig(configs=("baseline", "magic"))
    p = tmp_path / "c.toml"
    p.write_text("replica = 3\n")
    with pytest.raises(ValueError, match="replicas"):
        SimConfig.from_toml(p)


def test_mooncake_hash_ids_become_shared_token_prefixes(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}\n'
                 '{"timestamp": 500, "input_length": 1500, "output_length": 3, "hash_ids": [0, 1, 7]}\n'
                 '{"timestamp": 900, "input_length": 700, "output_length": 2, "hash_ids": [0, 2]}\n')
    a, b, c = mooncake_step(p)
    assert b.tokens[:1000] == a.tokens[:1000] and c.tokens[:512] == a.tokens[:512] and c.tokens[512:700] != a.tokens[512:700]
    assert b.arrival_s == 0.5 and b.turns == [(1500, 1503)]
