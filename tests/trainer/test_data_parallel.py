"""Data-parallel training (rollwise/trainer/data_parallel.py): two trainer processes over gloo take the
step one process takes, on real model forwards and backwards."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from rollwise import LLM, SamplingParams
from rollwise.agent.envs import ENVS
from rollwise.agent.envs.calculator import CalculatorEnv
from rollwise.rl_config import TrainConfig
from rollwise.rl_trainer import make_policy, make_trainer
from rollwise.trainer.data_parallel import Comm, Gloo
from rollwise.types import Trajectory, TurnRecord


def _groups(model_dir: str, n_groups: int, size: int, seed: int) -> list[list[Trajectory]]:
    """Groups sampled by our engine, of unequal lengths (so the ranks' shares differ), rewards mixed."""
    llm = LLM(model_dir, seed=seed)
    groups = []
    for g in range(n_groups):
        prompt = [5 + g, 17, 300 + g, 42] + [60 + g] * (3 * g)
        outs = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=4 + 3 * g, ignore_eos=True,
                                                     seed=100 * seed + 10 * g), n=size)
        group = []
        for i, o in enumerate(outs):
            turn = TurnRecord(start=len(prompt), num_generated=len(o.token_ids), num_observation=0,
                              finish_reason="length", policy_version=0, num_cached_tokens=0, generation_s=0,
                              tool_s=0, replica="r0")
            group.append(Trajectory(trajectory_id=f"t{g}.{i}", group_id=f"g{g}", task={},
                                    token_ids=prompt + o.token_ids,
                                    loss_mask=[0] * len(prompt) + [1] * len(o.token_ids),
                                    logprobs=[0.0] * len(prompt) + o.logprobs, turns=[turn],
                                    reward=float((i + g) % 3 == 0)))
        groups.append(group)
    return groups


def _weights(trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.policy.parameters()])


@pytest.mark.parametrize("options", [
    {},  # grpo, one update a step, whole batches (`step`) and streamed (`begin`, `add`, `finish`)
    {"epochs": 2, "kl_coef": 0.05, "entropy_coef": 0.01, "advantage": "rloo"},
    {"advantage": "reinforce_plus_plus", "group_size": 1},  # whitened over every rank's tokens
    {"advantage": "gae", "group_size": 1, "epochs": 2},  # and a critic, its gradients summed too
    {"reward_kl_coef": 0.05, "reward_kl_target": 0.01},  # KL in the reward: each rank computes a share
    {"advantage": "reinforce_plus_plus", "reward_kl_coef": 0.05},
], ids=["grpo", "epochs_kl_entropy", "whitened", "gae", "reward_kl", "reward_kl_whitened"])
def test_two_ranks_take_the_one_process_step(model_dir, tmp_path, options):
    cfg = TrainConfig.from_dict({"model": model_dir, "run_dir": str(tmp_path), "lr": 1e-3, "seed": 3,
                                 "trainer_threads": 2, "trainer_processes": 2, "micro_batch_tokens": 64, **options})
    groups = _groups(model_dir, 5, 4, seed=1)
    one = make_trainer(dataclasses.replace(cfg, trainer_processes=1), make_policy(cfg))
    two = make_trainer(cfg, make_policy(cfg))
    try:
        assert torch.equal(_weights(one), _weights(two))  # rank 0's weights, and the workers' from them
        for streamed in (False, True):
            if streamed:  # groups as they complete, in three calls
                for t in (one, two):
                    t.begin()
                    t.add(groups[:1])
                    t.add(groups[1:4])
                    t.add(groups[4:], True)
                m1, m2 = one.finish(), two.finish()
            else:
                m1, m2 = one.step(groups), two.step(groups)
            assert m1["trained_tokens"] == m2["trained_tokens"] > 0
            for k in ("loss", "grad_norm", "entropy", "kl", "is_weight_mean", "clip_frac", "value_loss",
                      "critic_grad_norm", "explained_var", "reward_kl", "reward_kl_coef"):
                if k not in m1:
                    continue
                assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
            w1, w2 = _weights(one), _weights(two)
            assert (w1 - w2).abs().max() < 1e-4  # (AdamW divides by the gradients' size: rounding grows)
            if "reward_kl_coef" in options:  # (the first step's policy is the reference: its KLs are 0)
                assert (m1["reward_kl"] != 0) == streamed
            if options.get("advantage") == "gae":  # the critics too
                assert "value_loss" in m1
                c1, c2 = (torch.cat([p.detach().reshape(-1) for p in t.critic.parameters()]) for t in (one, two))
                assert (c1 - c2).abs().max() < 1e-4 and c1.abs().max() > 0
        assert two.version == one.version == 2
        moved = (w1 - _weights(make_trainer(dataclasses.replace(cfg, trainer_processes=1), make_policy(cfg))))
        assert moved.abs().max() > 1e-4  # (the steps did change the weights)
    finally:
        two.close()


def test_each_rank_trains_its_share_and_every_rank_ends_on_the_same_bits(model_dir, tmp_path):
    """Each rank's gradients come from its own groups (rank 0's alone give other weights), and after
    the steps every rank holds the same weights, bit for bit (each takes the same summed gradients).
    With mini-batches, the k-th update takes every rank's k-th part (not the one-process partition)."""
    cfg = TrainConfig.from_dict({"model": model_dir, "run_dir": str(tmp_path), "lr": 1e-3, "seed": 3,
                                 "trainer_threads": 2, "trainer_processes": 2, "mini_batches": 2,
                                 "micro_batch_tokens": 64})
    groups = _groups(model_dir, 4, 4, seed=2)
    two = make_trainer(cfg, make_policy(cfg))
    try:
        for _ in range(2):
            m = two.step(groups)
            assert m["trained_tokens"] > 0 and m["grad_norm"] > 0 and m["loss"] == m["loss"]
        prints = two.fingerprints()
        assert len(prints) == 2 and prints[0] == prints[1]
        loads = [0.0, 0.0]
        mine = two.comm.shard(groups, loads)
        assert 0 < len(mine) < len(groups) and min(loads) > 0  # both ranks trained a share
        alone = make_trainer(dataclasses.replace(cfg, trainer_processes=1), make_policy(cfg))
        for _ in range(2):
            alone.step(mine)  # rank 0's share alone: not the steps the two ranks took
        assert (_weights(alone) - _weights(two)).abs().max() > 1e-5
        with pytest.raises(RuntimeError, match="no step begun"):  # a call that raises: the workers are stopped
            two.finish()
    finally:
        two.close()
    assert not any(proc.is_alive() for proc, _ in two.workers)


def test_a_worker_that_dies_before_joining_fails_the_start_at_once(model_dir, tmp_path):
    from rollwise.rl_trainer import trainer_rank
    from rollwise.trainer.data_parallel import share_weights, start, start_apart
    cfg = TrainConfig.from_dict({"model": model_dir, "run_dir": str(tmp_path)})
    with pytest.raises(RuntimeError, match="rollwise-trainer-rank1 exited"):
        start(2, trainer_rank, (cfg,), threads=0)  # (torch.set_num_threads(0) raises in the worker)
    with pytest.raises(RuntimeError, match=r"rollwise-trainer-rank0 exited \(exit code 1\) before joining"):
        start_apart(1, trainer_rank, (cfg,), 0, share_weights(make_policy(cfg).model))


def test_comm_of_one_process_is_the_identity():
    c = Comm()
    t = torch.ones(3)
    assert c.sum(t) is t and c.gather(5) == [5] and c.shard([[1], [2]], [0.0]) == [[1], [2]]


def test_trainer_processes_is_checked(model_dir):
    with pytest.raises(ValueError, match="trainer_processes must be >= 1"):
        TrainConfig.from_dict({"model": model_dir, "trainer_processes": 0})


class _ParityReward(CalculatorEnv):
    """Rewards an untrained model's answers half the time (by length), so GRPO has work to do."""

    scored: list[tuple[str, float]] = []  # (what each score was given, and gave: a failure's evidence)

    def score(self, task: dict, answer: str) -> float:
        _ParityReward.scored.append((answer, float(len(answer) % 2)))
        return self.scored[-1][1]


def _rollouts(run_dir) -> dict:
    """A run's groups by seq: each episode's status, reward, messages and tokens (what a deterministic
    run must repeat)."""
    groups = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]
    return {g["seq"]: [(t["status"], t["reward"], t["messages"], t["token_ids"]) for t in g["trajectories"]]
            for g in groups}


@pytest.mark.parametrize("options", [{"trainer_processes": 2}, {"trainer_apart": True}], ids=["two_ranks", "apart"])
def test_a_run_on_trainer_processes_trains_as_one_and_resumes(model_dir, tmp_path, monkeypatch, options):
    """`rollwise train` with trainer_processes = 2, or with the trainer apart: a deterministic run's
    steps (the same groups, from the warm start) are the one-process run's, the model the run saves
    holds what the trainer trained, and a resumed run hands the checkpoint to every rank."""
    from safetensors.torch import load_file

    from rollwise.rl import train
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    tiny = dict(env="calculator", sft_steps=3, sft_tasks=8, groups_per_step=2, group_size=4, max_tokens=12,
                max_turns=2, eval_tasks=0, max_num_seqs=16, progress=False, deterministic=True, model=model_dir,
                trainer_threads=2, lr=1e-3)
    one = train(TrainConfig.from_dict({**tiny, "run_dir": str(tmp_path / "one"), "steps": 2}))
    two = train(TrainConfig.from_dict({**tiny, "run_dir": str(tmp_path / "two"), "steps": 2, **options}))
    r1, r2 = _rollouts(tmp_path / "one"), _rollouts(tmp_path / "two")  # (the 4 groups the 2 steps trained on)
    parted = next(((seq, i) for seq in range(4) for i, (a, b) in enumerate(zip(r1[seq], r2[seq])) if a != b), None)
    why = ""  # where the runs' groups parted, if they did: each run's episode, what the env scored, the warm starts
    if parted is not None:
        seq, i = parted
        last = [(r[seq][i][:2], r[seq][i][2][-1]["content"], len(r[seq][i][3])) for r in (r1, r2)]
        scored = [x for x in _ParityReward.scored if x[0] in {t for _, t, _ in last}]
        why = (f"group {seq} episode {i}: one {last[0]!r}, two {last[1]!r}; scored {scored!r}; group {seq}: one "
               f"{[e[:2] for e in r1[seq]]}, two {[e[:2] for e in r2[seq]]}; SFT one {one['sft']}, two {two['sft']}")
    for a, b in zip(one["steps"], two["steps"]):
        assert a["trained_tokens"] == b["trained_tokens"] > 0, why
        if "trainer_apart" in options:  # one process, apart: the same arithmetic
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    w1, w2 = (load_file(str(tmp_path / d / "final-model" / "model.safetensors")) for d in ("one", "two"))
    # (saved by the run's process: apart, from the weights rank 0 trained in shared memory)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < (1e-9 if "trainer_apart" in options else 1e-4)
    more = train(TrainConfig.from_dict({**tiny, "run_dir": str(tmp_path / "two"), "steps": 3, **options}))
    assert more["policy_version"] == 3 and len(more["steps"]) == 3
    assert [s["loss"] for s in more["steps"][:2]] == [s["loss"] for s in two["steps"]]  # (the checkpoint's)
    assert more["steps"][2]["trained_tokens"] > 0


def test_a_worker_that_dies_mid_run_stops_it_with_a_clear_error(model_dir, tmp_path):
    """A worker killed (e.g. by the OOM killer) inside a step's collective, or between calls: rank 0
    raises at once, naming the process and its signal, instead of gloo's connection error."""
    import os
    import signal
    cfg = TrainConfig.from_dict({"model": model_dir, "run_dir": str(tmp_path), "lr": 1e-3, "seed": 3,
                                 "trainer_threads": 2, "trainer_processes": 2, "micro_batch_tokens": 64})
    groups = _groups(model_dir, 2, 4, seed=2)
    for between_calls in (False, True):
        two = make_trainer(cfg, make_policy(cfg))
        proc = two.workers[0][0]
        try:
            two.step(groups)
            if between_calls:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join()
            else:  # rank 0 reaches the gradients' sum after the worker died
                summed = two.comm.grads

                def grads(params):
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.join()
                    summed(params)
                two.comm.grads = grads
            with pytest.raises(RuntimeError, match=r"rollwise-trainer-rank1 exited \(SIGKILL.*during `step`.*resumes"):
                two.step(groups)
        finally:
            two.close()
    apart = make_trainer(dataclasses.replace(cfg, trainer_processes=1, trainer_apart=True), make_policy(cfg))
    try:  # the trainer apart's one process: its reply never comes
        os.kill(apart.workers[0][0].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"rollwise-trainer-rank0 exited \(SIGKILL.*during `step`"):
            apart.step(groups)
    finally:
        apart.close()


@pytest.mark.parametrize("processes,options", [(1, {}), (2, {}), (1, {"lora_rank": 4}),
                                               (1, {"advantage": "gae", "group_size": 1})],
                         ids=["one", "two_ranks", "lora", "gae"])
def test_a_trainer_apart_takes_the_steps_and_this_process_reads_its_weights(model_dir, tmp_path, processes, options):
    """trainer_apart: every rank a process of its own. Rank 0 trains this process's weights in shared
    memory, so after each step the policy here holds them (one process apart: the in-process
    trainer's bits; with LoRA, the adapters, and the merged weights the replicas get; PPO's critic
    trains there too, checkpointed with it); its errors come back with their type and the worker's
    traceback; checkpoints are written and read by the ranks themselves."""
    cfg = TrainConfig.from_dict({"model": model_dir, "run_dir": str(tmp_path), "lr": 1e-3, "seed": 3,
                                 "trainer_threads": 2, "trainer_processes": processes, "trainer_apart": True,
                                 "micro_batch_tokens": 64, **options})
    groups = _groups(model_dir, 4, 4, seed=2)
    mine = make_policy(cfg)
    one = make_trainer(dataclasses.replace(cfg, trainer_processes=1, trainer_apart=False), mine)
    policy = make_policy(cfg)
    apart = make_trainer(cfg, policy)  # (LoRA added to this process's policy, and shared with rank 0)
    apart_view = SimpleNamespace(policy=policy)  # (this process's policy, as `_weights` reads a trainer's)
    try:
        assert apart.trainer is None and len(apart.workers) == processes and apart.version == 0
        before = _weights(apart_view).clone()
        for _ in range(2):
            m1, m2 = one.step(groups), apart.step(groups)
            assert m1["trained_tokens"] == m2["trained_tokens"] > 0
            assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-6)
            if "advantage" in options:
                assert m2["value_loss"] == pytest.approx(m1["value_loss"], rel=1e-4) and m1["value_loss"] > 0
        assert apart.version == 2
        here = _weights(apart_view)
        assert (here - before).abs().max() > 1e-4  # (this process's view moved with rank 0's steps)
        assert (here - _weights(one)).abs().max() < (1e-9 if processes == 1 else 1e-4)
        if "lora_rank" in options:  # (the replicas' merged linears, read here)
            merged, want = policy.engine_weights(changed_only=True), mine.engine_weights(changed_only=True)
            assert merged.keys() == want.keys() and all(torch.equal(merged[k], want[k]) for k in want)
        assert len(set(apart.fingerprints())) == 1
        apart.save_checkpoint(str(tmp_path / "ckpt.pt"), {"history": ["x"]})
        state = torch.load(tmp_path / "ckpt.pt", weights_only=False)
        assert state["version"] == 2 and state["history"] == ["x"]
        assert (state["critic"] is not None) == ("advantage" in options)
        trained = [k for k, p in policy.model.named_parameters() if p.requires_grad]
        assert torch.equal(torch.cat([state["model"][k].reshape(-1) for k in trained]), here)
        apart.step(groups)
        apart.load_checkpoint(str(tmp_path / "ckpt.pt"))  # every rank back to version 2
        assert apart.version == 2 and torch.equal(_weights(apart_view), here)
        with pytest.raises(AttributeError, match="trainer runs apart"):
            apart.state()
        with pytest.raises(RuntimeError, match="no step begun") as raised:
            apart.finish()
        assert "in the trainer process" in "".join(raised.value.__notes__)
    finally:
        apart.close()
    assert not any(proc.is_alive() for proc, _ in apart.workers)


@pytest.mark.parametrize("processes,apart", [(2, False), (1, True), (2, True)], ids=["two_ranks", "apart", "apart_two"])
def test_the_warm_start_runs_on_the_trainer_ranks(model_dir, tmp_path, processes, apart):
    """SFT on the trainer's ranks (`TrainerRanks.sft`): each rank trains its share of every batch
    (a batch of 3 rows on 2 ranks: 2 and 1), the summed gradients take the one-process step (losses
    and weights within 1e-4; one process apart: bit for bit), every rank ends on the same bits, and
    the trainer is then built on the warm-started weights on every rank, LoRA added after it (apart:
    the adapters shared with rank 0, so the merged weights read here are the trained ones)."""
    import asyncio

    from rollwise.engine.tokenizer import Tokenizer
    from rollwise.rl import expert_trajectories
    from rollwise.rl_trainer import TrainerRanks
    env = CalculatorEnv()
    demos = asyncio.run(expert_trajectories(Tokenizer(model_dir), CalculatorEnv, env.sample_tasks(6, seed=0)))
    cfg = TrainConfig.from_dict({"model": model_dir, "run_dir": str(tmp_path), "lr": 1e-3, "seed": 3,
                                 "trainer_threads": 2, "trainer_processes": processes, "trainer_apart": apart,
                                 "sft_steps": 4, "sft_batch": 3, "sft_lr": 3e-3, "lora_rank": 4,
                                 "micro_batch_tokens": 256, "logprob_tolerance": 1.0})  # (groups: the base model's)
    alone = make_policy(cfg)  # (one process, through its rank: the SFT's threads set as apart)
    want = TrainerRanks(dataclasses.replace(cfg, trainer_processes=1, trainer_apart=False), alone).sft(demos)
    policy = make_policy(cfg)
    before = torch.cat([p.detach().reshape(-1).clone() for p in policy.model.parameters()])
    ranks = TrainerRanks(cfg, policy)
    try:
        seen = []
        got = ranks.sft(demos, lambda s, loss: seen.append(s))
        assert seen == [0, 1, 2, 3] and got == pytest.approx(want, rel=1e-4)
        if processes == 1:
            assert got == want
        here = torch.cat([p.detach().reshape(-1) for p in policy.model.parameters()])  # (apart: rank 0's)
        ref = torch.cat([p.detach().reshape(-1) for p in alone.model.parameters()])
        assert (here - before).abs().max() > 5e-4  # (warm-up: the first steps are small)
        assert (here - ref).abs().max() <= (0 if processes == 1 else 1e-4)
        trainer = ranks.trainer()
        assert policy.lora is not None and trainer.version == 0
        assert len(set(trainer.fingerprints())) == 1  # every rank on the same warm-started bits
        groups = _groups(model_dir, 2, 4, seed=2)
        assert trainer.step(groups)["trained_tokens"] > 0
        merged = policy.engine_weights(changed_only=True)  # (apart: read here, trained there)
        base = {k: v for k, v in alone.model.state_dict().items()}
        assert max(float((merged[k] - base[k]).abs().max()) for k in merged) > 0
    finally:
        ranks.close()


def test_rows_are_dealt_by_size_longest_first_onto_the_lightest_rank():
    """The warm start's rows (and the GRPO step's groups) go to ranks by size, not by position: rows of
    50, 40, 30, 20, 10, 10 tokens give each of 2 ranks 80 (by position, 90 and 70); every rank deals
    alike, so the shares cover the batch once; one process keeps it all, in order."""
    rows = [[0] * n for n in (50, 40, 30, 20, 10, 10)]
    shares = [Gloo.shard(SimpleNamespace(rank=r, world=2), rows, [0.0, 0.0], size=len) for r in (0, 1)]
    assert [sum(map(len, s)) for s in shares] == [80, 80]
    assert sorted(map(id, shares[0] + shares[1])) == sorted(map(id, rows))
    assert Comm().shard(rows, [0.0], size=len) == rows
