"""KV residency (thrashing control) in the router, on simulated replicas and the virtual clock."""
import asyncio

from rollwise.router.policies.rollwise import Rollwise
from rollwise.router.router import Router
from rollwise.sim.clock import run
from rollwise.sim.cost import LinearCost
from rollwise.sim.replica import SimReplica
from rollwise.types import GenerateRequest, SamplingParams

COST = LinearCost({"base_s": 1e-3, "per_token_s": 1e-5, "per_kv_token_s": 1e-7})


def _episode(router, tid, base, log):
    async def go():
        loop = asyncio.get_running_loop()
        ctx = list(base)
        for turn in range(3):
            out = [tid * 10 + turn] * 40
            log.append((tid, turn, "start", loop.time()))
            await router.generate(GenerateRequest(prompt_token_ids=list(ctx), forced_output=out, trajectory_id=f"t{tid}",
                                                  params=SamplingParams(max_tokens=40, ignore_eos=True), turn=turn))
            log.append((tid, turn, "end", loop.time()))
            ctx += out + [5] * 60
            await asyncio.sleep(1.0)  # a tool call: its context must survive it
        await router.end_trajectory(f"t{tid}", None, [], 3)
    return go()


def _run(kv_budget):
    log = []

    async def main():
        rep = SimReplica("r", COST, num_kv_blocks=128)  # 2048 tokens of KV
        router = Router([rep], Rollwise(kv_budget=kv_budget))
        await asyncio.gather(*(_episode(router, i, [100 + i] * 600, log) for i in range(3)))
        stats = dict(router.stats), rep.metrics()
        await router.close()
        rep.close()
        return stats
    stats = run(main())
    return log, stats


def test_when_contexts_outgrow_the_kv_budget_the_newest_resident_waits_and_nobody_thrashes():
    log, (rstats, rep) = _run(0.9)  # 3 x 600 tokens fit in 0.9 x 2048; after one turn 3 x 640 do not
    assert all(t < 0.2 for _, turn, ev, t in log if ev == "end" and turn == 0)  # all three admitted at once
    ends = {tid: t for tid, turn, ev, t in log if ev == "end" and turn == 2}
    t1 = {tid: t for tid, turn, ev, t in log if ev == "end" and turn == 1}
    newest = max(t1, key=t1.get)
    assert t1[newest] > min(e for tid, e in ends.items() if tid != newest)  # it waited for an older one to end
    assert rstats["held"] >= 1
    log2, (_, rep2) = _run(None)  # without residency all three interleave and lose their KV in tool calls
    assert max(t for _, turn, ev, t in log2 if ev == "end" and turn == 1) < min(t1.values()) + 1.5
    assert rep["prefill_tokens"] < rep2["prefill_tokens"]
    assert rep["prefill_tokens"] <= 3 * 720 + 640 + 64  # each context once, the waiting one once more
