"""The bounded-staleness group queue, driven by simulated producers and a trainer with random
timings: the bound holds for every group (per turn), k = 0 is exactly on-policy, errors surface."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from rollwise.rollout.pipeline import Group, GroupQueue, read_log
from rollwise.types import Trajectory, TurnRecord


def _traj(versions: list[int], tid: str = "t") -> Trajectory:
    turns = [TurnRecord(start=0, num_generated=1, num_observation=0, finish_reason="stop", policy_version=v,
                        num_cached_tokens=0, generation_s=0.0, tool_s=0.0) for v in versions]
    return Trajectory(trajectory_id=tid, group_id="g", task={}, token_ids=[1, 2], loss_mask=[0, 1],
                      logprobs=[0.0, -0.5], turns=turns, reward=1.0)


async def _simulate(k: int, B: int, steps: int, seed: int, concurrency: int = 12,
                    lockstep: bool = False, stream: bool = False, skip: float = 0.0) -> tuple[list, GroupQueue]:
    rng = random.Random(seed)
    q = GroupQueue(B, k, lockstep=lockstep)
    current = {"v": 0}  # the version the replicas serve (turns are stamped with it when they start)

    async def group() -> None:
        seq, v = await q.admit()
        versions = []
        for _ in range(rng.randint(1, 4)):  # turns; weights may change between (and during) them
            versions.append(v if lockstep else current["v"])  # lockstep: the replicas serve the pinned version
            await asyncio.sleep(rng.expovariate(1 / 0.004) if rng.random() < 0.9 else 0.05)  # heavy tail
        await q.put(Group(seq, seq, {}, v, [_traj(versions)]))

    async def producer() -> None:
        running: set = set()
        while True:
            while len(running) >= concurrency:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                running = {t for t in running if not t.done()}
            running.add(asyncio.create_task(group()))
            await asyncio.sleep(0)

    used = []
    prod = asyncio.create_task(producer())
    try:
        for step in range(steps):
            if stream or skip:  # a streamed trainer: each group as it may join, training between
                batch = []
                while len(batch) < B:
                    g = await q.next_group(len(batch))
                    if rng.random() < skip:  # dynamic sampling: not trained on, another admitted instead
                        await q.skip(g)
                        q.stats.setdefault("skipped_seqs", []).append(g.seq)
                        continue
                    batch.append(g)
                    await asyncio.sleep(rng.uniform(0, 0.002))
            else:
                batch = await q.get_batch()
            assert len(batch) == B
            used.append([(g.seq, q.version, g.version, [v for t in g.trajectories for v in t.policy_versions])
                         for g in batch])
            await asyncio.sleep(rng.uniform(0, 0.01))  # training
            current["v"] = step + 1  # weight sync, then commit
            await q.commit(step + 1)
    finally:
        prod.cancel()
    return used, q


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("seed,stream", [(0, False), (1, False), (2, True), (3, True)])
def test_staleness_never_exceeds_the_bound_per_turn(k, seed, stream):
    used, q = asyncio.run(_simulate(k, B=4, steps=25, seed=seed, stream=stream))
    seqs = [s for batch in used for s, *_ in batch]
    assert len(seqs) == len(set(seqs))  # no group used twice
    for batch in used:
        for _, trainer_version, _, turn_versions in batch:
            assert all(trainer_version - v <= k for v in turn_versions), (trainer_version, turn_versions)
    assert q.stats["max_staleness_seen"] <= k
    if k > 0:  # asynchrony is actually used
        assert q.stats["stale_groups"] > 0


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("seed", [4, 5])
def test_skipped_groups_are_replaced_and_the_bound_still_holds(k, seed):
    """Dynamic sampling: the trainer skips a third of the groups it takes; every batch still gets B
    groups to train on, each within the bound, and the run never stalls for want of admissions."""
    used, q = asyncio.run(_simulate(k, B=4, steps=20, seed=seed, skip=0.35))
    seqs = [s for batch in used for s, *_ in batch]
    skipped = q.stats["skipped_seqs"]
    assert len(seqs) == 20 * 4 and len(set(seqs) | set(skipped)) == len(seqs) + len(skipped)  # each once
    assert q.skipped == len(skipped) > 15
    for batch in used:
        for _, trainer_version, _, turn_versions in batch:
            assert all(trainer_version - v <= k for v in turn_versions), (trainer_version, turn_versions)
    assert q.stats["max_staleness_seen"] <= k
    with pytest.raises(ValueError, match="lockstep"):
        asyncio.run(GroupQueue(2, 1, lockstep=True).skip(Group(0, 0, {}, 0, [])))


@pytest.mark.parametrize("stream", [False, True])
def test_synchronous_mode_is_exactly_on_policy(stream):
    used, q = asyncio.run(_simulate(0, B=3, steps=20, seed=3, stream=stream))
    for batch in used:
        for _, trainer_version, group_version, turn_versions in batch:
            assert group_version == trainer_version and set(turn_versions) == {trainer_version}
    assert q.stats["stale_groups"] == 0


@pytest.mark.parametrize("k", [0, 1, 2])
def test_lockstep_runs_each_batch_under_one_version_whatever_the_timing(k):
    """Batch T is groups T*B.. (T+1)*B-1, pinned to version max(0, T - k): what a turn runs under
    does not depend on timing, so seeded runs repeat; a pin is never newer than the weights the
    trainer has published when the group is admitted, nor more than k older."""
    for seed in (0, 1):
        used, q = asyncio.run(_simulate(k, B=3, steps=12, seed=seed, lockstep=True))
        for T, batch in enumerate(used):
            assert [s for s, *_ in batch] == list(range(3 * T, 3 * T + 3))
            for _, trainer_version, group_version, turn_versions in batch:
                assert trainer_version == T and group_version == max(0, T - k)
                assert set(turn_versions) == {max(0, T - k)}

    async def pins():
        q = GroupQueue(3, k, lockstep=True)
        out = []
        for v in range(6):
            while q.may_admit():
                seq, pin = await q.admit()
                assert v - k <= pin <= v
                out.append(pin)
            await q.commit(v + 1)
        return out
    assert asyncio.run(pins())[:3 * (k + 2)] == [max(0, s // 3 - k) for s in range(3 * (k + 2))]
    # the free-running rule mixes versions within a batch under the same timings (what lockstep removes)
    used, _ = asyncio.run(_simulate(1, B=3, steps=12, seed=0))
    assert any(len({v for *_, tv in batch for v in tv}) > 1 for batch in used)


def test_lockstep_resume_with_groups_lost_in_flight_does_not_wait_for_them():
    async def go():
        q = GroupQueue(2, 1, version=1, admitted=6, lockstep=True)  # seqs 2, 3 were lost in flight
        q.restore([Group(4, 4, {}, 1, [_traj([1])]), Group(5, 5, {}, 1, [_traj([1])])])
        batch = await asyncio.wait_for(q.get_batch(), 1)
        assert [g.seq for g in batch] == [4, 5]
        await q.commit(2)
        seqs = [(await q.admit())[0] for _ in range(2)]
        waiting = asyncio.create_task(q.get_batch())
        await asyncio.sleep(0.01)
        assert seqs == [6, 7] and not waiting.done()  # the next batch waits for its groups to complete
        for s in seqs:
            await q.put(Group(s, s, {}, 2, [_traj([2])]))
        assert [g.seq for g in await asyncio.wait_for(waiting, 1)] == [6, 7]
    asyncio.run(go())


def test_a_streamed_trainer_gets_each_group_as_soon_as_it_may_join_the_batch():
    async def go():
        q = GroupQueue(2, 1)
        for _ in range(2):
            await q.admit()  # seqs 0, 1 at version 0: batch 0 may take any two complete groups
        await q.put(Group(1, 1, {}, 0, [_traj([0])]))
        assert q.has_next(0) and (await asyncio.wait_for(q.next_group(0), 1)).seq == 1  # 0 still running
        assert not q.has_next(1)
        waiting = asyncio.create_task(q.next_group(1))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await q.put(Group(0, 0, {}, 0, [_traj([0])]))
        assert (await asyncio.wait_for(waiting, 1)).seq == 0
        with pytest.raises(ValueError, match="taken"):
            await q.next_group(2)

        # the bound's stragglers keep their places: at version 1 with k = 1, seqs 2, 3 (admitted at
        # version 0) must be in batch 1, so seqs 4, 5 (complete, version 1) wait for batch 2
        assert [(await q.admit())[1] for _ in range(2)] == [0, 0]
        await q.commit(1)
        assert [(await q.admit())[1] for _ in range(2)] == [1, 1]
        for s in (4, 5):
            await q.put(Group(s, s, {}, 1, [_traj([1])]))
        got = []
        for i in range(2):
            nxt = asyncio.create_task(q.next_group(i))
            await asyncio.sleep(0.01)
            assert not nxt.done() and not q.has_next(i)
            await q.put(Group(3 - i, 3 - i, {}, 0, [_traj([0])]))  # seq 3 completes first
            got.append((await asyncio.wait_for(nxt, 1)).seq)
        assert got == [3, 2]
        await q.commit(2)
        assert [(await q.next_group(i)).seq for i in range(2)] == [4, 5]
    asyncio.run(go())


def test_admission_paces_producers():
    async def go():
        q = GroupQueue(2, 1)
        got = [await q.admit() for _ in range(4)]  # (k + 1) * B = 4 admitted at version 0
        assert [s for s, _ in got] == [0, 1, 2, 3]
        blocked = asyncio.create_task(q.admit())
        await asyncio.sleep(0.01)
        assert not blocked.done()
        await q.commit(1)
        assert await asyncio.wait_for(blocked, 1) == (4, 1)
    asyncio.run(go())


def test_producer_error_reaches_the_trainer_instead_of_hanging():
    async def go():
        q = GroupQueue(2, 0)
        waiting = asyncio.create_task(q.get_batch())
        await asyncio.sleep(0.01)
        await q.fail(ValueError("replicas all down"))
        with pytest.raises(RuntimeError, match="replicas all down"):
            await asyncio.wait_for(waiting, 1)
        with pytest.raises(RuntimeError):
            await q.admit()
    asyncio.run(go())


def test_log_round_trip_and_torn_last_line(tmp_path):
    async def go():
        q = GroupQueue(1, 0, log_path=tmp_path / "groups.jsonl")
        for _ in range(2):
            seq, v = await q.admit()
            await q.put(Group(seq, 10 + seq, {"q": "x"}, v, [_traj([v, v], f"t{seq}")]))
            await q.get_batch()
            await q.commit(q.version + 1)
    asyncio.run(go())
    with open(tmp_path / "groups.jsonl", "a") as f:
        f.write('{"seq": 2, "task_ind')  # a crash mid-write
    groups = read_log(tmp_path / "groups.jsonl", repair=True)
    assert [g.seq for g in groups] == [0, 1] and groups[1].task_index == 11
    with open(tmp_path / "groups.jsonl", "a") as f:  # an append after the repair stays readable
        f.write(groups[0].to_json() + "\n")
    assert len(read_log(tmp_path / "groups.jsonl")) == 3
    assert groups[1].trajectories[0].policy_versions == [1, 1] and groups[0].trajectories[0].logprobs == [0.0, -0.5]


def test_the_pre_rollout_filter_skips_by_streak_waits_for_earlier_groups_and_resumes(tmp_path):
    from rollwise.rollout.producer import PreRolloutFilter
    f = PreRolloutFilter(3, 0.5, seed=1, path=tmp_path / "skips.jsonl")
    for z in (1, 2, 3, 10):  # skipped with probability 1 - 0.5^z, at most 0.95; by the seed and cursor alone
        share = sum(f.decide(i, z) for i in range(4000)) / 4000
        assert abs(share - min(1 - 0.5 ** z, 0.95)) < 0.03
    assert not any(f.decide(i, 0) for i in range(100))  # a task that taught last time always runs
    assert [f.decide(i, 2) for i in range(50)] == [PreRolloutFilter(3, 0.5, seed=1).decide(i, 2) for i in range(50)]
    assert [f.decide(i, 2) for i in range(50)] != [PreRolloutFilter(3, 0.5, seed=2).decide(i, 2) for i in range(50)]

    async def go():
        assert not await f.skip(0)  # task 0, no history: runs
        later = asyncio.create_task(f.skip(3))  # task 0 again: waits for cursor 0's group
        await asyncio.sleep(0.05)
        assert not later.done()
        await f.done(0, False)  # it taught nothing: z = 1 for cursor 3
        first = await later
        if not first:
            await f.done(3, True)
        return first
    first = asyncio.run(go())
    assert f.streak(3) == (1, "hard") and f.streak(6)[0] == (1 if first else 0)  # a skipped cursor adds no outcome
    f.restore({1: False, 4: False, 7: True, 10: False})  # task 1's logged groups (a resume)
    assert [f.streak(i)[0] for i in (1, 4, 7, 10, 13)] == [0, 1, 2, 0, 1]
    n = 0
    for i in range(16, 16 + 3 * 40, 3):  # task 1 at z >= 1 on and on: some skipped, written down
        n += asyncio.run(f.skip(i))
        if i not in f.skipped:
            asyncio.run(f.done(i, False))
    assert n > 0 and f.take_count() == n + first and f.take_count() == 0
    again = PreRolloutFilter(3, 0.5, seed=1, path=tmp_path / "skips.jsonl")  # the file, read back
    assert again.skipped == f.skipped and len(again.skipped) == n + first
    with pytest.raises(ValueError, match=r"pre_rollout_explore must be in \(0, 1\]"):
        PreRolloutFilter(3, 0.0)
    with pytest.raises(ValueError, match=r"pre_rollout_target must be in \[0, 1\)"):
        PreRolloutFilter(3, 0.5, target=1.0)


def test_greso_adaptive_explore_moves_each_kind_toward_its_share_by_version():
    """pre_rollout_target: easy (all solved) and hard (none solved) tasks have probabilities of their
    own, each moved 0.01 a step toward its share of the target (a third, two thirds) of the groups the
    step took; a decision takes the values of the version its group was admitted under."""
    from rollwise.rollout.producer import MIN_RUN, PreRolloutFilter
    f = PreRolloutFilter(3, 0.5, seed=1, target=0.3, teaches=lambda trajs: len({t.reward for t in trajs}) > 1)
    def ep(reward: float):
        return dataclasses.replace(_traj([1]), reward=reward)
    assert f.outcome([ep(1.0)] * 2) == "easy" and f.outcome([ep(0.0)] * 2) == "hard" and f.outcome([ep(1), ep(0)])
    easy, hard, taught = [ep(1.0)] * 2, [ep(0.0)] * 2, [ep(1.0), ep(0.0)]
    # 10 groups: 3 easy (0.3 > 0.1: skip more), 1 hard (0.1 < 0.2: skip less)
    got = f.adapt(1, [easy] * 3 + [hard] + [taught] * 6)
    assert got == {"pre_rollout_p_easy": pytest.approx(0.49), "pre_rollout_p_hard": pytest.approx(0.51)}
    f.adapt(2, [easy] * 3 + [hard] + [taught] * 6)
    assert f.by_version[2] == {"easy": pytest.approx(0.48), "hard": pytest.approx(0.52)}
    assert f.adapt(3, []) == {} and 3 not in f.by_version  # (no groups: the values stand)
    for v in range(4, 200):  # bounded: [MIN_RUN, 1]
        f.adapt(v, [easy] * 10)
    assert f.by_version[199] == {"easy": MIN_RUN, "hard": 1.0}
    # decisions by the admitting version's values: at version 199 hard tasks always run, easy ones mostly not
    assert not any(f.decide(i, 3, "hard", 199) for i in range(200))
    assert sum(f.decide(i, 3, "easy", 199) for i in range(1000)) > 900
    assert [f.decide(i, 1, "easy", 2) for i in range(200)] == [f.decide(i, 1, "easy", 3) for i in range(200)]
    f.history[0] = {0: True, 3: "easy", 6: "hard"}
    assert f.streak(9) == (2, "hard") and f.streak(6) == (1, "easy")  # the latest group's kind
    again = PreRolloutFilter(3, 0.5, seed=1, target=0.3)  # a resume takes the checkpoint's values
    again.restore({}, {str(v): p for v, p in f.by_version.items()})
    assert again.by_version == f.by_version


def test_rollouts_and_evaluations_sample_with_the_runs_repetition_detection_and_thinking_budget(model_dir):
    """TrainConfig.repetition_detection and thinking_token_budget reach every turn's SamplingParams,
    the producer's and the evaluation's (the engine's tests check what they do there)."""
    from rollwise.agent.envs import make_env
    from rollwise.agent.generator import RecordingGenerator, ScriptedGenerator
    from rollwise.engine.tokenizer import Tokenizer
    from rollwise.rl import eval_episodes
    from rollwise.rl_config import TrainConfig
    from rollwise.rollout.producer import produce
    from rollwise.sampling import RepetitionDetectionParams
    rule = {"max_pattern_size": 4, "min_count": 3}
    gen = RecordingGenerator(ScriptedGenerator(Tokenizer(model_dir), lambda r: "42"))
    tasks = make_env("calculator").sample_tasks(4, seed=0)
    for given, budget, want in ((rule, 64, RepetitionDetectionParams(**rule)), (None, None, None)):
        cfg = TrainConfig.from_dict({"model": model_dir, "env": "calculator", "group_size": 2, "groups_per_step": 1,
                                     "repetition_detection": given, "thinking_token_budget": budget})

        async def go():
            q = GroupQueue(1, 0)
            prod = asyncio.create_task(produce(cfg, q, gen, lambda: make_env("calculator"), tasks, 0, set()))
            try:
                batch = await asyncio.wait_for(q.get_batch(), 30)
            finally:
                prod.cancel()
            evals = [g async for g in eval_episodes(gen, lambda: make_env("calculator"), tasks[:2], cfg)]
            return batch, evals
        gen.calls.clear()
        batch, evals = asyncio.run(go())
        assert len(batch[0].trajectories) == 2 and len(evals) == 2
        assert {r.trajectory_id.startswith("s") for r, _ in gen.calls} == {True, False}  # (both kinds of turn)
        assert all(r.params.repetition_detection == want and r.params.thinking_token_budget == budget
                   for r, _ in gen.calls)
    for bad, why in (({"repetition_detection": {"max_pattern_size": 4}}, "min_count must be >= 2"),
                     ({"repetition_detection": 4}, "repetition_detection"),
                     ({"thinking_token_budget": -4}, "thinking_token_budget")):
        with pytest.raises(ValueError, match=why):
            TrainConfig.from_dict({"model": "m", **bad})
