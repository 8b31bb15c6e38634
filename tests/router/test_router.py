"""The router's scheduling, failover and membership, on in-process fake replicas (fast, exact)."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rollwise.router.replica import LoadSnapshot, ReplicaError
from rollwise.router.router import Router
from rollwise.types import GenerateOutput, GenerateRequest, RequestOutput, SamplingParams


class FakeReplica:
    def __init__(self, name, delay=0.01, fail_after=None):
        self.name, self.delay, self.fail_after = name, delay, fail_after
        self.calls, self.active, self.max_active, self.alive = 0, 0, 0, True
        self.seen: list[str] = []

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        self.calls += 1
        if not self.alive or (self.fail_after is not None and self.calls > self.fail_after):
            self.alive = False
            raise ReplicaError(f"{self.name} is down")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.seen.append(req.request_id)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.active -= 1
        return GenerateOutput(token_ids=[7, 8], logprobs=[-0.1, -0.2], finish_reason="length")

    async def abort(self, request_id):
        pass

    async def health(self):
        return self.alive

    async def load(self):
        return LoadSnapshot(running=self.active)


def req(i, traj=None, group=None, turn=0, n=40):
    return GenerateRequest(prompt_token_ids=[i % 5] * n, params=SamplingParams(max_tokens=2), request_id=f"r{i}",
                           trajectory_id=traj, group_id=group, turn=turn)


def test_failover_loses_nothing_and_the_replica_rejoins():
    async def go():
        reps = [FakeReplica("a"), FakeReplica("b", fail_after=3), FakeReplica("c")]
        router = Router(reps, "round_robin", health_interval_s=0.05)
        outs = await asyncio.gather(*(router.generate(req(i, traj=f"t{i}")) for i in range(60)))
        assert len(outs) == 60 and all(o.token_ids == [7, 8] for o in outs)
        m = router.metrics()
        assert m["failovers"] >= 1 and m["retries"] >= 1 and "b" not in router.healthy
        reps[1].alive, reps[1].fail_after = True, None
        await asyncio.sleep(0.2)
        assert "b" in router.healthy  # back after its health check answered
        await router.close()
    asyncio.run(go())


def test_a_replica_that_missed_updates_of_a_subset_gets_every_tensor_sent_since():
    """LoRA sends the adapted linears alone after the first full update: a replica that missed
    some gets the full state with every later tensor on top, not just the last subset."""
    class Weights(FakeReplica):
        def __init__(self, name):
            super().__init__(name)
            self.held, self.down_for_updates = {}, False

        async def update_weights(self, weights, version, partial_rollout=False):
            if self.down_for_updates:
                raise ReplicaError(f"{self.name} is down")
            self.held.update(weights)
            return version

    async def go():
        a, b = Weights("a"), Weights("b")
        router = Router([a, b], "round_robin", health_interval_s=0.05)
        await router.start()
        await router.update_weights({"embed": 0, "q": 0, "v": 0}, 0)
        b.down_for_updates = True
        await router.update_weights({"q": 1}, 1)
        await router.update_weights({"v": 2}, 2)
        assert "b" in router.stale and b.held == {"embed": 0, "q": 0, "v": 0}
        b.down_for_updates = False
        await asyncio.sleep(0.2)
        assert "b" not in router.stale and b.held == a.held == {"embed": 0, "q": 1, "v": 2}
        await router.close()
    asyncio.run(go())


def test_new_weights_forget_the_prefixes_the_replicas_cached_under_older_ones():
    """After a weight update no replica is credited with a prefix of the old weights, not even one a
    request in flight across the update (finishing under the old weights) brings back."""
    class Weights(FakeReplica):
        async def update_weights(self, weights, version, partial_rollout=False):
            return version

    async def go():
        router = Router([Weights("a", delay=0.05), Weights("b", delay=0.05)], "rollwise")
        held = lambda: sum(router.index.num_blocks(n) for n in "ab")  # noqa: E731
        await router.generate(req(1))
        assert held() > 0
        across = asyncio.create_task(router.generate(req(2)))
        await asyncio.sleep(0.01)  # placed, in flight
        await router.update_weights({"w": 1}, 1)
        assert held() == 0
        await across
        assert held() == 0 and router.weight_updates == {"a": 1, "b": 1}
        await router.generate(req(3))
        assert held() > 0  # the new weights' prefixes are
        await router.close()
    asyncio.run(go())


def test_all_replicas_down_is_an_error_not_a_hang():
    async def go():
        router = Router([FakeReplica("a", fail_after=0)], "least_load", max_retries=2, queue_timeout_s=0.3)
        with pytest.raises((ReplicaError, asyncio.TimeoutError, TimeoutError)):
            await router.generate(req(1))
        await router.close()
    asyncio.run(go())


def test_a_request_that_failed_the_engine_step_is_not_the_replicas_fault():
    """A replica's "request_failed" (isolation.py: the request failed an engine step alone) reaches the
    caller as StepFailed: not retried, and the replica is neither marked down nor blamed."""
    from rollwise.engine.isolation import StepFailed
    from rollwise.router.replica import HttpReplica, LocalReplica

    class Culprit(FakeReplica):
        async def generate(self, r):
            if r.request_id == "r1":
                self.calls += 1
                raise StepFailed("request r1 failed the engine step")
            return await super().generate(r)

    async def go():
        reps = [Culprit("a"), Culprit("b")]
        router = Router(reps, "round_robin")
        with pytest.raises(StepFailed):
            await router.generate(req(1))
        assert sum(r.calls for r in reps) == 1 and router.healthy == {"a", "b"}
        assert len((await router.generate(req(2))).token_ids) == 2
        await router.close()
    asyncio.run(go())
    rep = HttpReplica("http://127.0.0.1:9")
    with pytest.raises(StepFailed, match="r1 failed"):
        rep._check(500, '{"error": {"message": "r1 failed", "type": "request_failed", "code": 500}}')
    for status, text in ((500, '{"error": {"message": "x", "type": "internal_server_error"}}'), (500, "oops"),
                         (503, "[1]")):
        with pytest.raises(ReplicaError):
            rep._check(status, text)
    rep._check(200, "not even json")

    class Engine:  # an in-process replica's engine, as AsyncEngine fails a culprit or dies
        def __init__(self, exc):
            self.exc = exc

        async def generate(self, request):
            raise self.exc

        async def stream(self, *a, **k):
            raise self.exc
            yield

    async def local(exc):
        outcomes = []
        for call in (lambda r: r.generate(req(1)), lambda r: r.stream(req(1)).__anext__()):
            try:
                await call(LocalReplica("x", Engine(exc)))
            except Exception as e:  # noqa: BLE001
                outcomes.append(type(e))
        return outcomes
    assert asyncio.run(local(StepFailed("r1 failed the engine step"))) == [StepFailed, StepFailed]
    assert asyncio.run(local(RuntimeError("the engine thread died"))) == [ReplicaError, ReplicaError]


def test_capacity_bounds_in_flight_and_the_queue_drains():
    async def go():
        reps = [FakeReplica("a", delay=0.02), FakeReplica("b", delay=0.02)]
        router = Router(reps, "least_load", max_inflight_per_replica=3)
        await asyncio.gather(*(router.generate(req(i)) for i in range(40)))
        assert max(r.max_active for r in reps) <= 3 and sum(r.calls for r in reps) == 40
        assert router.metrics()["queued"] > 0 and router.metrics()["queue_len"] == 0
        await router.close()
    asyncio.run(go())


def test_queue_order_longest_expected_work_first():
    async def go():
        rep = FakeReplica("a", delay=0.05)
        router = Router([rep], "rollwise", max_inflight_per_replica=1)
        await router.end_trajectory("x", "long", [1], num_turns=20)  # the "long" group runs 20 turns
        await router.end_trajectory("y", "short", [1], num_turns=2)
        blocker = asyncio.create_task(router.generate(req(0)))
        await asyncio.sleep(0.01)
        short = asyncio.create_task(router.generate(req(1, traj="s1", group="short", turn=1)))
        await asyncio.sleep(0.001)
        long = asyncio.create_task(router.generate(req(2, traj="l1", group="long", turn=1)))
        await asyncio.gather(blocker, short, long)
        assert rep.seen == ["r0", "r2", "r1"]  # the long trajectory overtook the short one
        await router.close()
    asyncio.run(go())


def test_stickiness_and_sibling_colocation():
    async def go():
        reps = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
        router = Router(reps, "rollwise", record_placements=True)
        for turn in range(3):  # 4 groups x 4 siblings, 3 turns each; turn k's prompt extends turn k-1's
            await asyncio.gather(*(router.generate(GenerateRequest(
                prompt_token_ids=[g] * 64 + [s + 10] * (16 * turn), params=SamplingParams(max_tokens=2),
                trajectory_id=f"g{g}/{s}", group_id=f"g{g}", turn=turn)) for g in range(4) for s in range(4)))
        by_traj, by_group = {}, {}
        for tid, gid, _, name in router.placements:
            by_traj.setdefault(tid, set()).add(name)
            by_group.setdefault(gid, set()).add(name)
        assert all(len(v) == 1 for v in by_traj.values())  # every turn of a trajectory on one replica
        assert all(len(v) == 1 for v in by_group.values())  # siblings together (low load)
        await router.close()
    asyncio.run(go())


def test_candidates_count_the_trajectories_living_on_each_replica():
    async def go():
        reps = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
        router = Router(reps, "round_robin", record_placements=True)  # 8 trajectories over 3: homes change

        def homes():
            want = {n: sum(1 for h in router.sticky.values() if h == n) for n in router.replicas}
            assert {n: c.homed for n, c in router._cands.items()} == want
            return want
        for turn in range(3):
            await asyncio.gather(*(router.generate(req(i, traj=f"t{i}", group="g", turn=turn)) for i in range(8)))
            assert sum(homes().values()) == 8
        last, moves = {}, 0
        for tid, _, _, name in router.placements:
            moves += last.get(tid, name) != name
            last[tid] = name
        assert moves > 0 and router.metrics()["moves"] == moves
        for i in range(4):
            await router.end_trajectory(f"t{i}", "g", [], 3)
        assert sum(homes().values()) == 4
        router.remove_replica("a")
        assert set(homes()) == {"b", "c"} and sum(homes().values()) == len(router.sticky)
        await router.close()
    asyncio.run(go())


def test_policies_see_candidates_in_the_replicas_order():
    """Not a set's order: string hashes differ between processes, and a policy's ties (the first of
    equals) must not, or the same simulated step gives different makespans run to run."""
    from rollwise.router.policies.least_load import LeastLoad
    seen = []

    class Recording(LeastLoad):
        def choose(self, info, cands):
            seen.append([c.name for c in cands])
            return super().choose(info, cands)

    async def go():
        names = [f"replica-{c}" for c in "qwertyuiop"]
        router = Router([FakeReplica(n) for n in names], Recording())
        await asyncio.gather(*(router.generate(req(i, traj=f"t{i}")) for i in range(4)))
        await router.close()
        return names
    names = asyncio.run(go())
    assert seen and all(s == [n for n in names if n in s] for s in seen) and len(seen[0]) == len(names)


def test_membership_changes_while_running():
    async def go():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = Router([a], "least_load")
        first = [asyncio.create_task(router.generate(req(i))) for i in range(10)]
        router.add_replica(b)
        more = [asyncio.create_task(router.generate(req(i))) for i in range(10, 30)]
        await asyncio.gather(*first, *more)
        assert b.calls > 0
        router.remove_replica("a")
        calls_a = a.calls
        await asyncio.gather(*(router.generate(req(i)) for i in range(30, 40)))
        assert a.calls == calls_a
        with pytest.raises(ValueError, match="already"):
            router.add_replica(b)
        with pytest.raises(ValueError, match="unknown replica"):
            router.remove_replica("zz")
        await router.close()
    asyncio.run(go())


def test_a_full_home_replica_is_waited_for_by_sticky_policies():
    async def go(policy):
        a, b = FakeReplica("a", delay=0.01), FakeReplica("b", delay=0.01)
        router = Router([a, b], policy, max_inflight_per_replica=1, record_placements=True)
        await router.generate(req(0, traj="t", turn=0, n=400))  # t lives on a (first placement: "a")
        a.delay = 0.2
        blocker = asyncio.create_task(router.generate(req(1, n=400)))  # fills a (least loaded: a or b)
        await asyncio.sleep(0.02)
        busy = "a" if a.active else "b"
        router.sticky["t"] = busy  # make t's home the busy replica
        await router.generate(req(2, traj="t", turn=1, n=400))
        await blocker
        await router.close()
        return [p for p in router.placements if p[0] == "t"][-1][3] == busy, router.metrics()["parked"]
    stayed, parked = asyncio.run(go("sticky_least_load"))
    assert stayed and parked == 1  # waited for its home replica
    stayed, parked = asyncio.run(go("least_load"))
    assert not stayed and parked == 0  # went to the free replica


def test_a_request_pinned_to_weights_one_replica_lacks_goes_to_one_that_holds_them(model_dir):
    """A replica that lacks a pinned version (restarted, say) is not marked down: the request is
    retried on one that holds it; if none does, the caller gets WeightsNotHeld."""
    from rollwise.engine.async_engine import AsyncEngine
    from rollwise.router.replica import LocalReplica
    from rollwise.types import WeightsNotHeld
    engines = {n: AsyncEngine(model_dir, keep_weight_versions=2) for n in ("a", "b")}

    async def go():
        state = {k: v.clone() for k, v in engines["a"].engine.runner.model.hf_tensors().items()}
        await engines["a"].update_weights(state, 1)  # only a holds version 1
        router = Router([LocalReplica(n, e) for n, e in engines.items()], "least_load")
        try:
            outs = await asyncio.gather(*(router.generate(GenerateRequest(
                prompt_token_ids=[5, 6, 7 + i], params=SamplingParams(max_tokens=4), policy_version=1))
                for i in range(6)))
            assert {o.replica for o in outs} == {"a"} and {o.policy_version for o in outs} == {1}
            assert router.healthy == {"a", "b"}
            with pytest.raises(WeightsNotHeld):
                await router.generate(GenerateRequest(prompt_token_ids=[5], params=SamplingParams(max_tokens=2),
                                                      policy_version=9))
            # an in-process engine streams too: pieces that add up to the whole, greedy
            greedy = GenerateRequest(prompt_token_ids=[5, 6, 7], params=SamplingParams(temperature=0, max_tokens=20,
                                                                                      ignore_eos=True, logprobs=2))
            whole = await router.generate(greedy)
            pieces = [p async for p in router.stream(greedy)]
            assert len(pieces) > 1 and [t for p in pieces for t in p.token_ids] == whole.token_ids
            assert [t for p in pieces for t in p.top_logprobs] == whole.top_logprobs
            assert [p.finish_reason for p in pieces] == [None] * (len(pieces) - 1) + ["length"]
        finally:
            await router.close()
    try:
        asyncio.run(go())
    finally:
        for e in engines.values():
            e.shutdown()


class StreamingReplica(FakeReplica):
    """Streams [1, 2, 3, 4] in pieces of two; `die_at` pieces in, the replica fails."""

    def __init__(self, name, die_at=None):
        super().__init__(name)
        self.die_at = die_at

    async def stream(self, req: GenerateRequest):
        self.calls += 1
        self.active += 1
        try:
            for i, ids in enumerate(([1, 2], [3, 4])):
                if self.die_at == i:
                    raise ReplicaError(f"{self.name} died")
                await asyncio.sleep(0.01)
                yield GenerateOutput(token_ids=ids, logprobs=[-0.5] * 2, finish_reason="length" if i else None,
                                     num_cached_tokens=7 if i else 0)
        finally:
            self.active -= 1


def test_streaming_through_the_router_retries_only_before_the_first_piece():
    async def pieces(router, r):
        return [p async for p in router.stream(r)]

    async def go():
        # a replica that fails before sending anything: the turn goes elsewhere, whole
        router = Router([StreamingReplica("a", die_at=0), StreamingReplica("b")], "round_robin", health_interval_s=60)
        got = await pieces(router, req(1, traj="t"))
        assert [p.token_ids for p in got] == [[1, 2], [3, 4]] and {p.replica for p in got} == {"b"}
        assert got[-1].finish_reason == "length" and got[0].finish_reason is None
        assert router.metrics()["retries"] == 1 and router.sticky.get("t") == "b" and router.stats["cached_tokens"] == 7
        # one that fails mid-stream: the error reaches the caller (its client saw tokens), the slot is freed
        router = Router([StreamingReplica("a", die_at=1)], "round_robin", health_interval_s=60)
        with pytest.raises(ReplicaError):
            await pieces(router, req(2))
        assert router.inflight["a"] == 0 and "a" not in router.healthy
        # a caller that stops reading frees the slot too; a replica that cannot stream sends one piece
        router = Router([StreamingReplica("a"), FakeReplica("b")], "round_robin", health_interval_s=60)
        stream = router.stream(req(3))
        await stream.__anext__()
        await stream.aclose()
        assert router.inflight["a"] == 0
        got = await pieces(router, req(4))
        assert [p.token_ids for p in got] == [[7, 8]] and got[0].replica == "b"
        await router.close()
    asyncio.run(go())


def test_a_turns_priority_reaches_the_replicas_engine():
    """GenerateRequest.priority (a replica's --scheduling-policy priority) goes in an HTTP replica's body
    and to an in-process replica's engine; 0, the default, is not sent (a replica of any policy takes it)."""
    from rollwise.router.replica import HttpReplica, LocalReplica
    rep = HttpReplica("http://127.0.0.1:9")
    assert rep._body(dataclasses.replace(req(1), priority=-2))["priority"] == -2 and "priority" not in rep._body(req(1))
    seen = []

    class Engine:
        async def generate(self, request):
            seen.append(request.priority)
            return GenerateOutput(token_ids=[1], logprobs=[0.0], finish_reason="length")

        async def stream(self, *a, **k):
            seen.append(k.get("priority", 0))
            yield RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[1], logprobs=[0.0], finished=True,
                                finish_reason="length")

    async def go():
        local = LocalReplica("x", Engine())
        await local.generate(dataclasses.replace(req(1), priority=3))
        async for _ in local.stream(dataclasses.replace(req(1), priority=4)):
            pass
        async for _ in local.stream(req(1)):
            pass
    asyncio.run(go())
    assert seen == [3, 4, 0]


def test_a_route_off_loopback_keeps_its_control_endpoints_for_key_holders():
    """`rollwise route --host 0.0.0.0` without --api-key: changing its replicas, pausing, flushing,
    aborting are refused (403), as weight updates are; listing and health stay open."""
    from fastapi.testclient import TestClient

    from rollwise.config import ServerConfig
    from rollwise.router.proxy import build_router_app
    router = Router([FakeReplica("a")], "round_robin")
    app = TestClient(build_router_app(router, ServerConfig(host="0.0.0.0")))
    for method, path in (("POST", "/replicas"), ("DELETE", "/replicas"), ("POST", "/pause"), ("POST", "/resume"),
                         ("POST", "/flush_cache"), ("POST", "/pause_generation"), ("POST", "/abort_request")):
        r = app.request(method, path, json={"url": "http://127.0.0.1:9"} if path == "/replicas" else {})
        assert r.status_code == 403 and "api-key" in r.json()["error"]["message"], path
    assert app.get("/replicas").status_code == 200 and set(router.replicas) == {"a"}


def test_a_salted_turn_is_indexed_under_its_salt_and_its_tokens_reach_only_its_salts_drafting():
    """vLLM's cache_salt through the router: a salted prompt matches only what the same salt left on
    a replica, and its tokens go to the other replicas' drafting caches under its salt."""
    class Drafter(FakeReplica):
        shared: list = []

        async def add_sequence(self, token_ids, group_id, cache_salt=None):
            self.shared.append((self.name, list(token_ids), cache_salt))

    async def go():
        router = Router([Drafter("a"), Drafter("b")], "dynamo")
        names = list(router.replicas)

        def held(salt):
            return router.index.match(router.index.hashes([1] * 40, None, salt), names)
        first = await router.generate(req(1))
        await asyncio.sleep(0.05)
        assert Drafter.shared == [("b" if first.replica == "a" else "a", [7, 8], None)]
        assert held(None)[first.replica] == 32 and held("s") == {"a": 0, "b": 0}
        salted = await router.generate(dataclasses.replace(req(6), cache_salt="s"))
        await asyncio.sleep(0.05)
        assert Drafter.shared[1:] == [(({"a", "b"} - {salted.replica}).pop(), [7, 8], "s")]
        assert held("s") == {salted.replica: 32, ({"a", "b"} - {salted.replica}).pop(): 0}
        assert held("t") == {"a": 0, "b": 0}
        await router.close()
    asyncio.run(go())


def test_the_routes_openapi_schema_names_each_operation_once():
    """As the server's (tests/serve/test_server.py): an operation id per method of /health_generate and /flush_cache."""
    from fastapi.testclient import TestClient

    from rollwise.config import ServerConfig
    from rollwise.router.proxy import build_router_app
    app = TestClient(build_router_app(Router([FakeReplica("a")], "round_robin"), ServerConfig()))
    paths = app.get("/openapi.json").json()["paths"]
    ops = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ops) == len(set(ops)) > 30 and {"get", "post"} <= set(paths["/flush_cache"])
