"""`rollwise.rl.train` end to end on a tiny model: in-process replicas, a trainer killed and resumed
(no completed group lost or repeated), and HTTP replicas with one killed mid-run."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rollwise.agent.envs import ENVS, make_env
from rollwise.agent.envs.calculator import CalculatorEnv
from rollwise.omp import passive_env
from rollwise.rl import TrainConfig, _sft_cache_path, train
from rollwise.rl_config import env_factory
from rollwise.rollout.task_sets import task_sets
from rollwise.rollout.pipeline import read_log
from rollwise.trainer.grpo import GRPOConfig
from rollwise.trainer.policy import PolicyModel
from rollwise.serve.process import ServerProcess

TINY = dict(env="calculator", sft_steps=3, sft_tasks=8, groups_per_step=2, group_size=2, max_tokens=12, max_turns=2,
            eval_tasks=4, max_num_seqs=16, progress=False, episode_deadline_s=60.0)


@pytest.mark.parametrize("partial_rollout,stream", [(False, True), (True, True), (False, False)])
def test_train_end_to_end_with_in_process_replicas(model_dir, tmp_path, partial_rollout, stream):
    cfg = TrainConfig.from_dict({**TINY, "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 3,
                                 "max_staleness": 1, "partial_rollout": partial_rollout, "stream_trainer": stream,
                                 "eval_every": 2, "loggers": ["tensorboard"]})
    report = train(cfg)
    assert len(report["steps"]) == 3 and report["policy_version"] == 3
    assert [s.get("eval_success") is not None for s in report["steps"]] == [False, True, False]  # after step 2
    assert 0.0 <= report["steps"][1]["eval_success"] <= 1.0 and report["steps"][1]["eval_s"] > 0
    assert 0.0 <= report["sft_success"] <= 1.0 and 0.0 <= report["rl_success"] <= 1.0
    for s in report["steps"]:
        assert s["trajectories"] == 4 and s["max_staleness"] <= 1 and s["sync_s"] > 0 and s["tail_s"] > 0
        assert all(s["step"] - v <= 1 for v in s["group_versions"])
    out = Path(cfg.run_dir)
    assert (out / "report" / "curves.png").stat().st_size > 1000
    assert json.loads((out / "report" / "metrics.json").read_text())["rl_success"] == report["rl_success"]
    assert (out / "final-model" / "config.json").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard"))  # the SFT model's evaluation at 0, step n's metrics at n + 1
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward")] == [1, 2, 3]
    assert [e.step for e in acc.Scalars("eval_success")] == [0, 2, 3]
    from rollwise.engine.tokenizer import Tokenizer  # the final model is whole: it has its tokenizer
    assert Tokenizer(str(out / "final-model")).encode("a b") == Tokenizer(model_dir).encode("a b")
    for g in read_log(out / "groups.jsonl"):  # every token's version, oldest first, none from the future
        for t in g.trajectories:
            for tr in t.turns:
                v = tr.token_versions()
                assert v == sorted(v) and all(tr.policy_version <= x <= 3 for x in v)
                assert partial_rollout or tr.version_segments == []


class _ParityReward(CalculatorEnv):
    """Rewards an untrained model's answers half the time (by length), so GRPO has work to do."""

    def score(self, task: dict, answer: str) -> float:
        return float(len(answer) % 2)


def test_deterministic_runs_repeat_bit_for_bit(model_dir, tmp_path, monkeypatch):
    """The same seed twice (lockstep pipeline, behaviour recomputed by the trainer): the same turns
    under the same versions, the same weights; each batch ran under exactly one version."""
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    runs = []
    for name in ("a", "b"):
        cfg = TrainConfig.from_dict({**TINY, "model": model_dir, "run_dir": str(tmp_path / name), "steps": 4,
                                     "max_staleness": 1, "deterministic": True})
        report = train(cfg)
        state = torch.load(Path(cfg.run_dir) / "checkpoint.pt", weights_only=False)
        used = set(state["consumed"])  # (groups in flight when the run stopped were never trained on)
        logged = sorted((g for g in read_log(Path(cfg.run_dir) / "groups.jsonl") if g.seq in used), key=lambda g: g.seq)
        runs.append((report, logged, state["model"]))
    (ra, la, wa), (rb, lb, wb) = runs
    assert len(la) == 4 * 2
    assert sum(s["trained_trajectories"] for s in ra["steps"]) > 0  # the weights did move
    for s in ra["steps"]:
        assert set(s["group_versions"]) == {max(0, s["step"] - 1)}
    key = [[(t.trajectory_id, t.token_ids, t.policy_versions, t.reward) for t in g.trajectories] for g in la]
    assert key == [[(t.trajectory_id, t.token_ids, t.policy_versions, t.reward) for t in g.trajectories] for g in lb]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [s["loss"] for s in ra["steps"]] == [s["loss"] for s in rb["steps"]]
    assert ra["rl_success"] == rb["rl_success"]


def test_replicas_asleep_while_the_trainer_trains_leave_a_run_as_it_was(model_dir, tmp_path, monkeypatch):
    """Sleep mode in synchronous runs: at each step's training every replica gives back its KV pool
    (1) or its weights too (2; every weight is then sent), and takes them back for the next step's
    rollouts. A deterministic run's weights are those of the run without it, bit for bit; the
    rollouts of a run whose replicas lost their weights still check against the trainer's logprobs."""
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    weights = []
    for level, deterministic in ((0, True), (2, True), (1, False)):
        cfg = TrainConfig.from_dict({**TINY, "model": model_dir, "run_dir": str(tmp_path / str(level)), "steps": 3,
                                     "max_staleness": 0, "deterministic": deterministic, "stream_trainer": False,
                                     "replica_sleep": level, "eval_tasks": 0})
        steps = train(cfg)["steps"]
        assert [s.get("replicas_slept") for s in steps] == [level and 2 or None] * 3
        weights.append(torch.load(Path(cfg.run_dir) / "checkpoint.pt", weights_only=False)["model"])
        # the trainer checked fresh samples' logprobs (a mismatch stops the run): the replicas served its weights
        assert any(s["logprob_diff"] < 0.02 for s in steps)
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    for bad, why in (({"replica_sleep": 1, "max_staleness": 1, "stream_trainer": False}, "max_staleness = 0"),
                     ({"replica_sleep": 1, "max_staleness": 0}, "stream_trainer = false"),
                     ({"replica_sleep": 3, "max_staleness": 0, "stream_trainer": False}, "0, 1 .KV pools. or 2"),
                     ({"replica_sleep": 2, "max_staleness": 0, "stream_trainer": False, "lora_rank": 4,
                       "lora_sync": "adapter"}, "adapter alone")):
        with pytest.raises(ValueError, match=why):
            TrainConfig.from_dict({"model": model_dir, **bad})


def test_a_gae_run_trains_groups_of_one_resumes_with_its_critic_and_saves_models(model_dir, tmp_path, monkeypatch):
    """PPO's critic in the pipeline: groups of one episode, value metrics every step, and a resumed
    run goes on with the critic it saved (a new one starts at 0: its value head is zero). The model
    is saved every step, the last two kept."""
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    cfg = {**TINY, "model": model_dir, "run_dir": str(tmp_path / "run"), "advantage": "gae", "group_size": 1,
           "groups_per_step": 4, "eval_tasks": 0, "deterministic": True, "save_every": 1, "keep_saved": 2}
    first = train(TrainConfig.from_dict({**cfg, "steps": 2}))["steps"]
    assert [s["trajectories"] for s in first] == [4, 4] and first[0]["value_mean"] == 0.0
    assert first[0]["trained_trajectories"] > 0 and first[1]["value_mean"] != 0.0
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["critic"]["head"]["weight"]
    assert saved.abs().sum() > 0
    assert sorted(p.name for p in (tmp_path / "run" / "models").iterdir()) == ["step-1", "step-2"]
    later = train(TrainConfig.from_dict({**cfg, "steps": 3}))["steps"]
    assert len(later) == 3 and later[2]["value_mean"] != 0.0 and 0 <= later[2]["value_clip_frac"] <= 1
    models = tmp_path / "run" / "models"
    assert sorted(p.name for p in models.iterdir()) == ["step-2", "step-3"]  # the last two
    from safetensors.torch import load_file
    last, final = (load_file(str(d / "model.safetensors")) for d in (models / "step-3", models.parent / "final-model"))
    assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in last)
    assert (models / "step-2" / "tokenizer.json").exists()  # a model directory that serves as it is


def test_an_on_policy_distillation_run_rewards_each_token_by_a_teachers_kl(model_dir, tmp_path):
    """examples/train-phonebook-distill.toml's settings on the tiny model: a teacher of another size
    (reference_model) values every sampled token; the run trains on it with no warm start."""
    from rollwise.make_model import make_model
    teacher = make_model(tmp_path / "teacher", family="qwen3", layers=1, hidden=96, heads=4, kv_heads=2, vocab=1024,
                         std=0.1, seed=11, tie=True, head_dim=24)
    example = TrainConfig.from_toml(Path(__file__).parents[2] / "examples" / "train-phonebook-distill.toml",
                                    model=model_dir, reference_model=str(teacher))
    opd = {k: getattr(example, k) for k in ("reward_kl_coef", "advantage", "gae_gamma", "reference_model", "sft_steps")}
    assert opd == {"reward_kl_coef": 1.0, "advantage": "reinforce_plus_plus", "gae_gamma": 0.0,
                   "reference_model": str(teacher), "sft_steps": 0}
    steps = train(TrainConfig.from_dict({**TINY, **opd, "model": model_dir, "run_dir": str(tmp_path / "run"),
                                         "steps": 2, "eval_tasks": 0}))["steps"]
    assert len(steps) == 2 and all(s["reward_kl"] > 0.5 and s["trained_trajectories"] > 0 for s in steps)


def test_a_remax_run_trains_groups_of_one_against_a_greedy_episode_per_group(model_dir, tmp_path, monkeypatch):
    """ReMax: each group runs one more episode at temperature 0, not trained on or logged; its reward is
    each episode's baseline, and an episode trains where its reward differs from it."""
    import rollwise.rollout.producer as producer
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    ran, run_attempts = {}, producer.run_attempts

    async def recorded(router, make_env, task, params, **kw):
        t = await run_attempts(router, make_env, task, params, **kw)
        ran[kw["trajectory_id"]] = (params.temperature, t.reward)
        return t
    monkeypatch.setattr(producer, "run_attempts", recorded)
    cfg = {**TINY, "model": model_dir, "run_dir": str(tmp_path / "run"), "advantage": "remax", "group_size": 1,
           "groups_per_step": 4, "eval_tasks": 0, "steps": 2, "temperature": 1.0, "max_staleness": 0}
    steps = train(TrainConfig.from_dict(cfg))["steps"]
    assert [s["trajectories"] for s in steps] == [4, 4] and all("greedy_reward" in s for s in steps)
    groups = read_log(tmp_path / "run" / "groups.jsonl")
    assert len(groups) == 8 and all(len(g.trajectories) == 1 for g in groups)
    for g in groups:
        t = g.trajectories[0]
        gid = t.trajectory_id.split("/")[0]
        assert ran[t.trajectory_id] == (1.0, t.reward) and ran[f"{gid}/greedy"] == (0.0, t.baseline)
    differ = sum(t.reward != t.baseline for g in groups for t in g.trajectories)
    assert 0 < differ == sum(s["trained_trajectories"] for s in steps)


def test_a_streamed_run_trains_whitened_advantages_as_groups_arrive(model_dir, tmp_path, monkeypatch):
    """Streamed (not deterministic) with stream_whitened, gae's and REINFORCE++'s first passes run as each
    group but the last arrives and the step whitens their gradients at the end (SplitGradients.apply,
    once a step); gae with KL in the reward, its beta adapted after each step."""
    from rollwise.trainer.losses import SplitGradients
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    applied = []
    real = SplitGradients.apply
    monkeypatch.setattr(SplitGradients, "apply", lambda self, mean, std: applied.append(std) or real(self, mean, std))
    checkpointed, enable = [], PolicyModel.enable_checkpointing
    monkeypatch.setattr(PolicyModel, "enable_checkpointing", lambda self: checkpointed.append(1) or enable(self))
    for advantage in ("gae", "reinforce_plus_plus_baseline"):
        applied.clear()
        cfg = {**TINY, "model": model_dir, "run_dir": str(tmp_path / advantage), "advantage": advantage, "steps": 2,
               "groups_per_step": 3, "eval_tasks": 0, "max_staleness": 1, "stream_whitened": True}
        if advantage == "gae":  # with KL in the reward, adaptive (a short horizon: beta moves visibly), and in
            # the loss (the reward's reference rows), under gradient checkpointing (the policy's and the critic's)
            cfg.update(reward_kl_coef=0.05, reward_kl_target=1e-3, reward_kl_horizon=10, kl_coef=0.01,
                       gradient_checkpointing=True, micro_batch_tokens=2048)
        steps = train(TrainConfig.from_dict(cfg))["steps"]
        if advantage == "gae":
            assert steps[0]["reward_kl_coef"] == 0.05 and steps[1]["reward_kl_coef"] != 0.05
            assert steps[0]["reward_kl"] == 0.0 < abs(steps[1]["reward_kl"])  # the reference, then not
            assert abs(steps[0]["kl"]) < 1e-6 < steps[1]["kl"] and len(checkpointed) == 1
        assert len(applied) == 2 and all(s > 0 for s in applied)
        assert all(s["trained_trajectories"] > 0 and s["entropy"] > 0 and abs(s["loss"]) < 10 for s in steps)
        assert all(s["logprob_diff"] < 0.02 for s in steps if s["logprob_diff"] == s["logprob_diff"])
        assert ("value_loss" in steps[0]) == (advantage == "gae")


def test_batch_invariant_replicas_repeat_a_deterministic_run_however_it_is_batched(model_dir, tmp_path, monkeypatch):
    """With replica_batch_invariant, one replica taking up to 16 turns at a time and two replicas taking
    3 each give the same rollouts to the last bit of every logprob, hence the same weights."""
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    runs = []
    for name, replicas, seqs in (("a", 1, 16), ("b", 2, 3)):
        cfg = TrainConfig.from_dict({**TINY, "model": model_dir, "run_dir": str(tmp_path / name), "steps": 2,
                                     "max_staleness": 1, "deterministic": True, "replica_batch_invariant": True,
                                     "replicas": replicas, "max_num_seqs": seqs, "eval_tasks": 0})
        train(cfg)
        state = torch.load(Path(cfg.run_dir) / "checkpoint.pt", weights_only=False)
        used = set(state["consumed"])
        logged = sorted((g for g in read_log(Path(cfg.run_dir) / "groups.jsonl") if g.seq in used), key=lambda g: g.seq)
        runs.append(([[(t.token_ids, t.logprobs) for t in g.trajectories] for g in logged], state["model"]))
    (la, wa), (lb, wb) = runs
    assert len(la) == 2 * 2 and la == lb
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="replica_dtype"):
        TrainConfig.from_dict({"model": model_dir, "replica_batch_invariant": True, "replica_dtype": "bfloat16"})


def test_a_true_on_policy_run_trains_on_ratios_of_exactly_one(model_dir, tmp_path, monkeypatch):
    """Synchronous (max_staleness 0): every sample is fresh, its trainer logprobs are the rollout's bit
    for bit, so the importance weight is 1 and nothing is clipped in the first epoch."""
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    cfg = TrainConfig.from_dict({**TINY, "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 3,
                                 "max_staleness": 0, "replica_batch_invariant": True, "true_on_policy": True,
                                 "eval_tasks": 0, "seed": 1})
    trained = [s for s in train(cfg)["steps"] if s["trained_trajectories"]]  # (others compare nothing)
    assert trained
    for s in trained:
        assert s["logprob_diff"] == 0.0 and s["is_weight_mean"] == 1.0 and s["clip_frac"] == 0.0
    with pytest.raises(ValueError, match="replica_batch_invariant"):
        TrainConfig.from_dict({"model": model_dir, "true_on_policy": True})


def test_a_deterministic_true_on_policy_run_needs_no_recompute(model_dir, tmp_path, monkeypatch):
    """Stale samples too: the replicas' logprobs under each version are what the trainer computes
    under that version's kept weights, so taking them as they are (no recompute, no kept weights)
    trains to the same weights, bit for bit, as recomputing them."""
    import rollwise.trainer.grpo as grpo
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    weights = {}
    for behaviour in ("rollout", "recompute"):
        if behaviour == "recompute":  # what a deterministic run does without true on-policy
            monkeypatch.setattr(grpo, "GRPOConfig", lambda **kw: GRPOConfig(**{**kw, "behaviour": "recompute"}))
        cfg = TrainConfig.from_dict({**TINY, "model": model_dir, "run_dir": str(tmp_path / behaviour), "steps": 4,
                                     "max_staleness": 1, "deterministic": True, "replica_batch_invariant": True,
                                     "true_on_policy": True, "eval_tasks": 0, "seed": 1})
        steps = train(cfg)["steps"]
        assert sum(s["trained_trajectories"] for s in steps) > 0 and max(s["max_staleness"] for s in steps) == 1
        weights[behaviour] = torch.load(Path(cfg.run_dir) / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(weights["rollout"][k], weights["recompute"][k]) for k in weights["rollout"])


def test_true_on_policy_over_http_needs_batch_invariant_servers(model_dir, tmp_path, monkeypatch):
    """Logprobs that crossed HTTP as JSON are still the engine's bits: a `--batch-invariant` server's
    match the trainer's exactly; a default server is refused at the start, naming what to do."""
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    common = {**TINY, "model": model_dir, "steps": 2, "max_staleness": 0, "true_on_policy": True, "eval_tasks": 0,
              "seed": 1}
    with ServerProcess(model_dir, "--max-num-seqs", "16", "--batch-invariant", "--kv-cache-gb", "0.1") as s:
        cfg = TrainConfig.from_dict({**common, "run_dir": str(tmp_path / "a"), "replica_urls": [s.url]})
        trained = [x for x in train(cfg)["steps"] if x["trained_trajectories"]]
    assert trained and all(x["logprob_diff"] == 0.0 for x in trained)
    with ServerProcess(model_dir, "--max-num-seqs", "16", "--kv-cache-gb", "0.1") as s:
        cfg = TrainConfig.from_dict({**common, "run_dir": str(tmp_path / "b"), "replica_urls": [s.url]})
        with pytest.raises(ValueError, match="--batch-invariant"):  # asked before anything runs
            train(cfg)


@pytest.mark.parametrize("deterministic", [False, True])
def test_killed_trainer_resumes_without_losing_or_repeating_groups(model_dir, tmp_path, deterministic):
    run = tmp_path / "run"
    cfg = tmp_path / "cfg.toml"
    lines = [f"model = {json.dumps(model_dir)}", f"run_dir = {json.dumps(str(run))}", "steps = 8", "max_staleness = 2",
             f"deterministic = {str(deterministic).lower()}"]
    lines += [f"{k} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}" for k, v in TINY.items()]
    cfg.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "rollwise.cli", "train", str(cfg)]
    env = passive_env()
    log = tmp_path / "first.log"  # a file, not a pipe nobody reads while the run writes its progress
    with log.open("wb") as err:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    ckpt = run / "checkpoint.pt"
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if ckpt.exists() and len(torch.load(ckpt, weights_only=False)["history"]) >= 2:
            break
        time.sleep(0.05)
    assert p.poll() is None, log.read_text(errors="replace")[-2000:]
    p.send_signal(signal.SIGKILL)
    p.wait()
    before = torch.load(ckpt, weights_only=False)
    logged_before = read_log(run / "groups.jsonl")
    assert len(before["history"]) < 8 and logged_before
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sft_success=" in done.stdout
    after = torch.load(ckpt, weights_only=False)
    consumed = after["consumed"]
    assert len(after["history"]) == 8 and after["version"] == 8
    assert len(consumed) == len(set(consumed)) == 8 * 2  # no group trained on twice
    assert consumed[: len(before["consumed"])] == before["consumed"]  # committed steps kept
    # every group complete before the kill was used after it (none lost), none regenerated
    assert {g.seq for g in logged_before} <= set(consumed)
    logged = read_log(run / "groups.jsonl")
    assert len({g.task_index for g in logged}) == len(logged)
    assert len({g.seq for g in logged}) == len(logged)
    for s in after["history"]:
        assert all(s["step"] - v <= 2 for v in s["group_versions"])
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(8))  # the live log: each step once, across the kill
    assert [s["loss"] for s in steps] == [s["loss"] for s in after["history"]]


@pytest.mark.parametrize("via", ["auto", "broadcast"])
def test_replica_killed_mid_run_fails_over_without_losing_trajectories(model_dir, tmp_path, via):
    """(With "broadcast", the updates after the kill fail in the group and reach the survivor as a file;
    the next one builds the group again without the dead replica.)"""
    with ServerProcess(model_dir, "--max-num-seqs", "16") as a, ServerProcess(model_dir, "--max-num-seqs", "16") as b:
        cfg = TrainConfig.from_dict({**TINY, "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 4,
                                     "max_staleness": 1, "replica_urls": [a.url, b.url], "replica_weights_via": via})
        ckpt = Path(cfg.run_dir) / "checkpoint.pt"

        def killer():
            while not ckpt.exists():
                time.sleep(0.05)
            b.proc.kill()
        threading.Thread(target=killer, daemon=True).start()
        report = train(cfg)
    assert len(report["steps"]) == 4 and report["policy_version"] == 4
    groups = read_log(Path(cfg.run_dir) / "groups.jsonl")
    assert all(len(g.trajectories) == 2 and all(t.status != "error" for t in g.trajectories) for g in groups)
    late = [t for g in groups if g.admitted_version >= 2 for t in g.trajectories]
    assert late and all(tr.replica == a.url for t in late for tr in t.turns)  # only the survivor served them
    if via == "broadcast":  # the first weights and 4 steps' through the group, but one that found b gone
        last = report["steps"][-1]  # (if the health loop had not taken b out of the members before it)
        assert last["broadcast_updates"] + last["broadcast_fallbacks"] == 5 and last["broadcast_updates"] >= 4, last


def test_example_config_is_the_demo_run(model_dir):
    """examples/train-phonebook.toml parses and sets what `rollwise demo` runs."""
    from rollwise.cli import DEMO_FULL
    cfg = TrainConfig.from_toml(Path(__file__).parents[2] / "examples" / "train-phonebook.toml", model=model_dir)
    assert cfg.env == "phonebook" and {k: getattr(cfg, k) for k in DEMO_FULL} == DEMO_FULL
    bugfix = TrainConfig.from_toml(Path(__file__).parents[2] / "examples" / "train-bugfix.toml", model=model_dir)
    assert bugfix.env == "bugfix" and bugfix.max_turns >= len(make_env("bugfix").expert({"module": "m", "buggy": "gcd"}))
    airline = TrainConfig.from_toml(Path(__file__).parents[2] / "examples" / "train-airline.toml", model=model_dir)
    longest = max(len(make_env("airline").expert(t)) for t in make_env("airline").sample_tasks(50, seed=0))
    assert airline.env == "airline" and airline.max_turns >= longest
    lake = TrainConfig.from_toml(Path(__file__).parents[2] / "examples" / "train-frozenlake.toml", model=model_dir)
    assert (lake.env, lake.env_options, lake.advantage) == ("frozenlake", {"view": "local"}, "gigpo")
    assert make_env(lake.env, **lake.env_options).view == "local"
    with pytest.raises(ValueError, match="replica_weights_via"):
        TrainConfig.from_dict({"model": model_dir, "replica_weights_via": "nfs"})
    with pytest.raises(ValueError, match="partial_rollout does nothing"):
        TrainConfig.from_dict({"model": model_dir, "deterministic": True, "partial_rollout": True})
    with pytest.raises(ValueError, match="trainer_threads"):
        TrainConfig.from_dict({"model": model_dir, "trainer_threads": -1})


def test_train_on_a_user_env_and_task_files(model_dir, tmp_path):
    """examples/train-units.toml: an env class from a file of its own, tasks from JSON lines, SFT on
    its expert's transcripts of the training tasks, evaluation on the eval file's first tasks."""
    ex = Path(__file__).parents[2] / "examples"
    cfg = TrainConfig.from_toml(ex / "train-units.toml", **{
        **TINY, "env": f"{ex}/units_env.py:UnitsEnv", "train_tasks_file": str(ex / "units-train.jsonl"),
        "eval_tasks_file": str(ex / "units-eval.jsonl"), "model": model_dir, "run_dir": str(tmp_path / "run"),
        "steps": 2})
    assert cfg.env_options == {"tool_timeout": 5.0}
    train_tasks, sft_tasks, eval_tasks = task_sets(cfg, 64)
    assert len(train_tasks) == 256 and sft_tasks == train_tasks[:8]
    assert [t["id"] for t in eval_tasks] == [f"units-eval-{i}" for i in range(4)]
    env = env_factory(cfg)()
    assert env.max_turns == 2 and env.tool_timeout == 5.0  # the standard options, then env_options
    report = train(cfg)
    assert len(report["steps"]) == 2 and report["eval_tasks"] == 4 and 0 <= report["rl_success"] <= 1
    logged = read_log(Path(cfg.run_dir) / "groups.jsonl")
    assert logged and all(g.task["id"] == f"units-train-{g.task_index}" for g in logged)  # the file, in order
    assert report["sft"]["examples"] == 8


@pytest.mark.parametrize("memory,api", [("history", "chat"), ("notes", "chat"), ("history", "responses")])
def test_train_an_agent_written_against_the_openai_api(model_dir, tmp_path, memory, api):
    """examples/train-phonebook-agent.toml: the demo's run with the task as an openai-SDK agent
    (its settings are the demo config's but for the env), trained through the agent gateway; with
    memory="notes" the agent starts a new context after each tool call; api="responses": the
    agent speaks the Responses API."""
    ex = Path(__file__).parents[2] / "examples"
    demo = TrainConfig.from_toml(ex / "train-phonebook.toml", model=model_dir)
    cfg = TrainConfig.from_toml(ex / "train-phonebook-agent.toml", model=model_dir)
    differ = {f for f in TrainConfig.__dataclass_fields__ if getattr(cfg, f) != getattr(demo, f)}
    assert differ == {"env", "env_options", "run_dir"} and cfg.env == "agent"
    cfg = TrainConfig.from_toml(ex / "train-phonebook-agent.toml", **{
        **TINY, "env": "agent", "max_tokens": 24, "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 2,
        "sft_cache": str(tmp_path / "sft")})
    cfg.env_options["agent_options"] = {"memory": memory, "api": api}
    report = train(cfg)
    assert len(report["steps"]) == 2 and report["sft"]["examples"] == 8 and 0 <= report["rl_success"] <= 1
    assert all(m["contexts"] >= 1.0 for m in report["steps"])
    sft = report["sft"]  # the expert's transcripts: with notes, a second context after its tool call
    assert sft["contexts"] == sft["examples"] + (memory == "notes") * (sft["examples"] - sft["direct_answers"])
    assert sft["direct_answers"] < sft["examples"]
    trajs = [t for g in read_log(Path(cfg.run_dir) / "groups.jsonl") for t in g.trajectories]
    assert trajs and all(t.status in ("done", "max_turns", "max_context", "error") for t in trajs)
    seqs = [s for t in trajs for s in t.sequences()]
    assert all(s.messages[0]["content"].startswith("You answer questions about the staff") for s in seqs)
    assert all(sum(s.loss_mask) == sum(r.num_generated for r in s.turns) > 0 for s in seqs)
    if memory == "history":
        assert not any(t.earlier for t in trajs)
    else:  # every context after the first comes after a tool call, and starts with the notes
        assert all("Found so far:" in s.messages[1]["content"] for t in trajs for s in t.sequences()[1:])


def test_the_sft_cache_is_keyed_by_what_makes_the_transcripts(model_dir, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"question": "1 + 1", "answer": 2}\n')
    base = {**TINY, "model": model_dir, "sft_cache": str(tmp_path / "sft")}

    def path(**kw):
        return _sft_cache_path(TrainConfig.from_dict({**base, **kw}))
    agent = {"agent": "examples/phonebook_agent.py:PhonebookAgent"}
    keys = {path(), path(seed=1), path(sft_steps=4), path(env="agent", env_options=agent),
            path(env="agent", env_options={**agent, "agent_options": {"memory": "notes"}}),
            path(env="dataset", train_tasks_file=str(tasks))}
    assert len(keys) == 6 and path() == path() and path(steps=9, lr=1.0) == path()  # (RL settings: same warm start)
    tasks.write_text('{"question": "2 + 2", "answer": 4}\n')
    assert path(env="dataset", train_tasks_file=str(tasks)) not in keys
    assert path(sft_steps=0) is None and path(sft_cache=None) is None


def test_train_an_agent_program_on_a_task_file(model_dir, tmp_path):
    """env_options.command: a program per episode (examples/phonebook_agent_cli.py), tasks from a file."""
    ex = Path(__file__).parents[2] / "examples"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in make_env("phonebook").sample_tasks(6, seed=1)))
    cfg = TrainConfig.from_dict({**TINY, "env": "agent", "env_options": {"command": [sys.executable, str(ex / "phonebook_agent_cli.py")]},
                                 "sft_steps": 0, "train_tasks_file": str(tasks), "eval_tasks": 0, "max_tokens": 24,
                                 "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 2})
    report = train(cfg)
    assert len(report["steps"]) == 2 and report["steps"][-1]["trajectories"] == 4
    trajs = [t for g in read_log(Path(cfg.run_dir) / "groups.jsonl") for t in g.trajectories]
    assert trajs and all(t.status in ("done", "max_turns", "max_context") for t in trajs), [t.error for t in trajs]
    assert all(t.messages[0]["content"].startswith("You answer questions about the staff") for t in trajs)


@pytest.mark.parametrize("layout", ["jsonl", "verl-parquet"])
def test_train_on_a_task_file_with_the_dataset_env(model_dir, tmp_path, layout):
    """No env class at all: the dataset env, a built-in reward, a user's tool function, a task file
    (ours, or the same tasks in verl's Parquet layout, read as they are)."""
    ex = Path(__file__).parents[2] / "examples"
    opts = {"reward": "number", "tools": [f"{ex}/units_env.py:convert"], "prompt_key": "question"}
    tasks = ex / "units-train.jsonl"
    questions = {json.loads(line)["question"] for line in tasks.read_text().splitlines()}
    if layout == "verl-parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        rows = [{"data_source": "units", "prompt": [{"role": "user", "content": t["question"]}], "ability": "units",
                 "reward_model": {"style": "rule", "ground_truth": str(t["answer"])}}
                for t in map(json.loads, tasks.read_text().splitlines())]
        tasks, opts = tmp_path / "units-train.parquet", {**opts, "prompt_key": "prompt"}
        pq.write_table(pa.Table.from_pylist(rows), tasks)
    cfg = TrainConfig.from_dict({**TINY, "env": "dataset", "env_options": opts, "sft_steps": 0, "model": model_dir,
                                 "train_tasks_file": str(tasks), "eval_tasks": 0,
                                 "run_dir": str(tmp_path / "run"), "steps": 2})
    report = train(cfg)
    assert len(report["steps"]) == 2 and report["sft_success"] is None and report["rl_success"] is None
    trajs = [t for g in read_log(Path(cfg.run_dir) / "groups.jsonl") for t in g.trajectories]
    assert trajs and all(t.status in ("done", "max_turns") for t in trajs)
    assert all(t.messages[1]["role"] == "user" and t.messages[1]["content"].split("\n")[0] in questions for t in trajs)


def test_train_with_tools_from_an_mcp_server(model_dir, tmp_path):
    """examples/train-units-mcp.toml: the dataset env with its tools from an MCP server, a real
    subprocess (examples/units_mcp_server.py) shared by the run's episodes: the warm start's
    transcripts call it, and so may the policy's."""
    ex = Path(__file__).parents[2] / "examples"
    cfg = TrainConfig.from_toml(ex / "train-units-mcp.toml", **{
        **TINY, "env": "dataset", "train_tasks_file": str(ex / "units-train.jsonl"), "eval_tasks": 0,
        "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 2, "max_tokens": 24})
    server = cfg.env_options["mcp"]["units"]
    server.update(command=sys.executable, args=[str(ex / "units_mcp_server.py")])
    report = train(cfg)
    assert report["sft"]["examples"] == 8 and report["sft"]["expert_success"] == 1.0  # its calls were answered
    assert len(report["steps"]) == 2
    trajs = [t for g in read_log(Path(cfg.run_dir) / "groups.jsonl") for t in g.trajectories]
    assert trajs and all(t.status in ("done", "max_turns") for t in trajs), [t.error for t in trajs]


def test_train_on_a_reward_models_scores(model_dir, rm_dir, tmp_path):
    """reward = "model": every episode scored by a learned reward model, loaded once for the run."""
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"Say something about {w}."}) + "\n" for w in ("cats", "rain")))
    cfg = TrainConfig.from_dict({**TINY, "env": "dataset", "sft_steps": 0, "eval_tasks": 0, "model": model_dir,
                                 "env_options": {"reward": "model", "reward_model": {"path": rm_dir}},
                                 "train_tasks_file": str(tasks), "run_dir": str(tmp_path / "run"), "steps": 2})
    report = train(cfg)
    trajs = [t for g in read_log(Path(cfg.run_dir) / "groups.jsonl") for t in g.trajectories]
    assert len(report["steps"]) == 2 and trajs and all(t.status == "done" for t in trajs)
    rewards = [t.reward for t in trajs]
    assert len(set(rewards)) > 1 and not all(r in (0.0, 1.0) for r in rewards)  # the model's scores, not a rule's


def test_a_run_directory_resumes_only_the_run_it_holds(model_dir, tmp_path):
    """Resuming with other tasks or env settings would train the logged groups and cursor of one run
    on another's: refused, naming what differs; steps may grow."""
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n" for i in range(8)))
    base = {**TINY, "env": "dataset", "env_options": {"reward": "exact"}, "train_tasks_file": str(tasks),
            "sft_steps": 0, "eval_tasks": 0, "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 1}
    assert len(train(TrainConfig.from_dict(base))["steps"]) == 1
    for change, named in (({"env_options": {"reward": "contains"}}, "env_options"), ({"seed": 3}, "seed"),
                          ({"group_size": 4}, "group_size")):
        with pytest.raises(ValueError, match=f"holds a run with other {named} .*: set another run_dir"):
            train(TrainConfig.from_dict({**base, **change, "steps": 2}))
    tasks.write_text(tasks.read_text() + json.dumps({"prompt": "Say 9.", "answer": "9"}) + "\n")
    with pytest.raises(ValueError, match="other train_tasks_file"):
        train(TrainConfig.from_dict({**base, "steps": 2}))
    tasks.write_text("".join(tasks.read_text().splitlines(keepends=True)[:8]))
    assert len(train(TrainConfig.from_dict({**base, "steps": 2}))["steps"]) == 2  # the same run, one more step


def test_train_with_search_r1s_protocol(model_dir, tmp_path, monkeypatch):
    """env search_r1 (examples/train-search-r1.toml's settings, a smaller run): a warm start on tagged
    transcripts, then GRPO steps whose episodes are one assistant message each."""
    ex = Path(__file__).parents[2] / "examples"
    subprocess.run([sys.executable, str(ex / "search_corpus.py"), str(tmp_path / "w"), "--protocol", "search_r1"],
                   check=True, capture_output=True)
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path / "cache"))
    opts = {"reward": "em", "search": {"corpus": str(tmp_path / "w" / "corpus.jsonl"), "top_k": 3}}
    cfg = TrainConfig.from_dict({**TINY, "env": "search_r1", "env_options": opts, "sft_steps": 3, "sft_tasks": 8,
                                 "train_tasks_file": str(tmp_path / "w" / "train.jsonl"), "max_turns": 4,
                                 "eval_tasks_file": str(tmp_path / "w" / "eval.jsonl"), "eval_tasks": 2,
                                 "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 2})
    report = train(cfg)
    assert len(report["steps"]) == 2 and report["steps"][-1]["trajectories"] == 4
    trajs = [t for g in read_log(Path(cfg.run_dir) / "groups.jsonl") for t in g.trajectories]
    assert trajs and all(t.status in ("done", "max_turns", "max_context") for t in trajs), [t.error for t in trajs]
    assert all([m["role"] for m in t.messages] == ["user", "assistant"] for t in trajs)
    assert all(t.messages[0]["content"].endswith(t.task["question"]) for t in trajs)
    step = report["steps"][-1]  # what the step's episodes were like: turns, tokens, the env's counts
    assert 1 <= step["turns"] <= 4 and step["generated_per_episode"] > 0 and 0 <= step.get("env_calls", 0) <= 4


def test_dynamic_sampling_trains_only_on_groups_with_a_reward_spread(model_dir, tmp_path):
    """Even tasks reward every episode alike (zero advantage), odd ones by the answer's length: with
    dynamic sampling every trained group has a spread, the skipped ones have none, each group is
    taken once, and a killed-and-resumed run would know which were skipped (checkpoint)."""
    (tmp_path / "r.py").write_text("def score(task, answer):\n"
                                   "    return 1.0 if task['n'] % 2 == 0 else float(len(answer) % 2)\n")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}.", "n": i}) + "\n" for i in range(64)))
    cfg = TrainConfig.from_dict({**TINY, "env": "dataset", "env_options": {"reward": f"{tmp_path}/r.py:score"},
                                 "train_tasks_file": str(tmp_path / "t.jsonl"), "sft_steps": 0, "eval_tasks": 0,
                                 "group_size": 4, "steps": 3, "dynamic_sampling": True, "max_skipped_groups": 40,
                                 "model": model_dir, "run_dir": str(tmp_path / "run")})
    report = train(cfg)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    by_seq = {g.seq: g for g in read_log(tmp_path / "run" / "groups.jsonl")}
    spread = {s: len({t.reward for t in by_seq[s].trajectories}) > 1 for s in by_seq}
    assert len(state["consumed"]) == 3 * 2 and all(spread[s] for s in state["consumed"])
    assert state["skipped"] and not any(spread[s] for s in state["skipped"])
    assert not set(state["consumed"]) & set(state["skipped"])
    assert sum(s["skipped_groups"] for s in report["steps"]) == len(state["skipped"])
    assert all(s["trained_trajectories"] > 0 for s in report["steps"])
    with pytest.raises(ValueError, match="dynamic_sampling cannot be deterministic"):
        TrainConfig.from_dict({"model": model_dir, "dynamic_sampling": True, "deterministic": True})


def test_the_pre_rollout_filter_skips_tasks_that_taught_nothing_before_running_them(model_dir, tmp_path):
    """Even tasks reward every episode alike: after a group that taught nothing, a task is skipped before
    its rollouts with probability 1 - explore^z. Every skipped place followed such a group of its task,
    none ran, and a resumed run keeps the decisions (none run again, none decided again)."""
    (tmp_path / "r.py").write_text("def score(task, answer):\n"
                                   "    return 1.0 if task['n'] % 2 == 0 else float(len(answer) % 2)\n")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}.", "n": i}) + "\n" for i in range(6)))
    cfg = {**TINY, "env": "dataset", "env_options": {"reward": f"{tmp_path}/r.py:score"}, "sft_steps": 0,
           "train_tasks_file": str(tmp_path / "t.jsonl"), "eval_tasks": 0, "group_size": 4, "steps": 4,
           "pre_rollout_explore": 0.2, "model": model_dir, "run_dir": str(tmp_path / "run")}
    first = train(TrainConfig.from_dict(cfg))["steps"]
    later = train(TrainConfig.from_dict({**cfg, "steps": 8}))["steps"]
    run = tmp_path / "run"
    skipped = [json.loads(line)["task_index"] for line in (run / "pre_rollout.jsonl").read_text().splitlines()]
    ran = {g.task_index: g for g in read_log(run / "groups.jsonl")}
    assert skipped and len(set(skipped)) == len(skipped) and not set(skipped) & set(ran)
    for idx in skipped:  # the task's latest group before it taught nothing
        before = max(i for i in ran if i % 6 == idx % 6 and i < idx)
        assert len({t.reward for t in ran[before].trajectories}) == 1
    assert sum(i % 2 == 0 for i in skipped) > sum(i % 2 == 1 for i in skipped)
    assert len(later) == 8 and sum(s["pre_rollout_skipped"] for s in first + later[4:]) <= len(skipped)
    with pytest.raises(ValueError, match="pre_rollout_explore"):
        TrainConfig.from_dict({"model": model_dir, "pre_rollout_explore": 1.5})
    with pytest.raises(ValueError, match="pre_rollout_explore skips .* gae trains such groups too"):
        TrainConfig.from_dict({"model": model_dir, "pre_rollout_explore": 0.5, "advantage": "gae"})


@pytest.mark.parametrize("target", [0.0, 0.3], ids=["fixed", "adaptive"])
def test_a_deterministic_run_with_the_pre_rollout_filter_repeats_its_decisions(model_dir, tmp_path, target):
    """The same tasks run and skipped, the same weights; with GRESO's adaptive explore too, whose
    probabilities each step reports and the checkpoint keeps by version."""
    (tmp_path / "r.py").write_text("def score(task, answer):\n"
                                   "    return 1.0 if task['n'] % 2 == 0 else float(len(answer) % 2)\n")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}.", "n": i}) + "\n" for i in range(3)))
    runs = []
    for name in ("a", "b"):
        cfg = {**TINY, "env": "dataset", "env_options": {"reward": f"{tmp_path}/r.py:score"}, "sft_steps": 0,
               "train_tasks_file": str(tmp_path / "t.jsonl"), "eval_tasks": 0, "group_size": 4, "steps": 5,
               "deterministic": True, "pre_rollout_explore": 0.3, "pre_rollout_target": target, "model": model_dir,
               "run_dir": str(tmp_path / name)}
        train(TrainConfig.from_dict(cfg))
        state = torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)
        if target:
            assert sorted(state["pre_rollout_explore"]) == list(range(6))  # (version 0's, then each step's)
            assert all({"pre_rollout_p_easy", "pre_rollout_p_hard"} <= set(h) for h in state["history"])
        used = {g.seq: g.task_index for g in read_log(tmp_path / name / "groups.jsonl") if g.seq in state["consumed"]}
        skips = [json.loads(x)["task_index"] for x in (tmp_path / name / "pre_rollout.jsonl").read_text().splitlines()]
        runs.append((used, [i for i in skips if i < max(used.values())], state["model"]))  # (decided by then)
    (used_a, skips_a, model_a), (used_b, skips_b, model_b) = runs
    assert used_a == used_b and skips_a and skips_a == skips_b  # the same tasks run, the same skipped
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)


def test_episodes_whose_env_raised_are_run_again_not_trained_as_failures(model_dir, tmp_path):
    """The first env made for each task raises in reset (a flaky environment): that episode runs again
    and the run trains on its second attempt; the log and the step metrics say so."""
    (tmp_path / "flaky.py").write_text(
        "from rollwise.agent.envs.calculator import CalculatorEnv\n"
        "SEEN = set()\n"
        "class Flaky(CalculatorEnv):\n"
        "    def reset(self, task):\n"
        "        if task['id'] not in SEEN:\n"
        "            SEEN.add(task['id'])\n"
        "            raise ConnectionError('sandbox went away')\n"
        "        return super().reset(task)\n")
    cfg = TrainConfig.from_dict({**TINY, "env": f"{tmp_path}/flaky.py:Flaky", "model": model_dir, "sft_steps": 0,
                                 "run_dir": str(tmp_path / "run"), "steps": 2, "eval_tasks": 0})
    report = train(cfg)
    trajs = [t for g in read_log(Path(cfg.run_dir) / "groups.jsonl") for t in g.trajectories]
    assert trajs and all(t.status != "error" for t in trajs)
    assert [sum(len(t.retried) for t in g.trajectories) for g in read_log(Path(cfg.run_dir) / "groups.jsonl")] == \
        [1] * len(read_log(Path(cfg.run_dir) / "groups.jsonl"))  # one per task: its first env
    assert all("sandbox went away" in r for t in trajs for r in t.retried)
    assert sum(s["retried"] for s in report["steps"]) == 4  # 2 steps x 2 groups


@pytest.mark.parametrize("sync,deterministic,exact", [("merged", False, False), ("adapter", False, False),
                                                    ("adapter", True, False), ("merged", False, True),
                                                    ("adapter", False, True)])
def test_lora_trains_adapters_and_the_replicas_serve_the_merged_weights(model_dir, tmp_path, monkeypatch, sync,
                                                                        deterministic, exact):
    """LoRA after the warm start: each step sends the replicas the merged linears alone (or the
    adapter alone, served on the warm start they hold), and the trainer's check of fresh samples'
    logprobs (on-policy: every sample checked) passes, so the replicas serve exactly the merged
    weights; the final model is the warm start with the adapter merged (every other tensor
    unchanged) and the adapter loads with peft."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    cfg = TrainConfig.from_dict({**TINY, "model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 2,
                                 "group_size": 4, "max_staleness": 0, "lora_rank": 4, "lora_alpha": 8, "lr": 1e-2,
                                 "lora_sync": sync, "deterministic": deterministic,
                                 "replica_batch_invariant": exact, "true_on_policy": exact})
    report = train(cfg)
    run = Path(cfg.run_dir)
    warm = load_file(str(run / "warm-start-model" / "model.safetensors"))
    linears = sum(t.nbytes for k, t in warm.items() if k.endswith("proj.weight")) / 2**20  # what "all-linear" adapts
    adapter = sum(t.nbytes for t in load_file(str(run / "final-adapter" / "adapter_model.safetensors")).values())
    sent = linears if sync == "merged" else adapter / 2**20
    assert all(s["sync_mb"] == pytest.approx(sent) for s in report["steps"])
    assert linears < sum(t.nbytes for t in warm.values()) / 2**20 and adapter / 2**20 < linears / 4
    checked = [s["logprob_diff"] for s in report["steps"] if s["trained_tokens"] > 0]
    assert checked and all(d == 0.0 if exact else 0 <= d < 0.02 for d in checked)  # true on-policy: bit for bit
    final = load_file(str(run / "final-model" / "model.safetensors"))
    assert warm.keys() == final.keys()
    moved = {k for k in warm if not torch.equal(warm[k], final[k])}
    assert moved and all(k.endswith("proj.weight") for k in moved)  # the adapted linears, nothing else
    base = AutoModelForCausalLM.from_pretrained(str(run / "warm-start-model"), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(run / "final-adapter")).merge_and_unload().state_dict()
    assert all(torch.allclose(merged[k], final[k], atol=1e-6) for k in moved)
    # resumed: the checkpoint holds the adapters; one more step trains them on
    again = train(TrainConfig.from_dict({**cfg.__dict__, "steps": 3}))
    assert len(again["steps"]) == 3 and again["policy_version"] == 3


def test_user_env_without_sample_tasks_needs_a_task_file(model_dir, tmp_path):
    (tmp_path / "bare.py").write_text(
        "from rollwise.agent.envs.calculator import CalculatorEnv\n"
        "class Bare(CalculatorEnv):\n    sample_tasks = None\n    expert = None\n"
        "    def __init__(self, max_turns=4):\n        super().__init__(max_turns=max_turns)\n")
    base = {"model": model_dir, "env": f"{tmp_path}/bare.py:Bare", "sft_steps": 0}
    assert task_sets(TrainConfig.from_dict(base), 8) == ([], [], [])
    with pytest.raises(ValueError, match="no sample_tasks.*train_tasks_file"):
        train(TrainConfig.from_dict({**base, "run_dir": str(tmp_path / "run")}))
    (tmp_path / "t.jsonl").write_text(json.dumps({"question": "1 + 1?", "expression": "1 + 1", "answer": 2}) + "\n")
    cfg = TrainConfig.from_dict({**base, "train_tasks_file": str(tmp_path / "t.jsonl")})
    assert env_factory(cfg)().max_turns == cfg.max_turns  # takes max_turns, not tool_latency
    train_tasks, _, eval_tasks = task_sets(cfg, 8)
    assert train_tasks == [{"id": "t-0", "question": "1 + 1?", "expression": "1 + 1", "answer": 2}] and eval_tasks == []
    with pytest.raises(ValueError, match="unknown env.*available"):
        TrainConfig.from_dict({"model": model_dir, "env": "sqll"})
    with pytest.raises(ValueError, match="epochs and mini_batches must be >= 1, got 0, 1"):
        TrainConfig.from_dict({"model": model_dir, "epochs": 0})


def test_replicas_and_trainer_split_the_cores(monkeypatch):
    """In-process replicas and the trainer run at once: by default each gets its share of the cores
    (at least one thread), never all of them each."""
    from rollwise.rollout.fleet import threads

    def cfg(**kw):
        return TrainConfig.from_dict({"model": "m", **kw})
    for cores, want in ((2, (1, 1)), (16, (5, 6)), (1, (1, 1))):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert threads(cfg()) == want
    assert threads(cfg(replicas=3)) == (1, 1)  # (1 core)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert threads(cfg(replica_urls=["http://10.0.0.5:8000"])) == (16, 16)  # replicas elsewhere
    assert threads(cfg(replica_threads=2, trainer_threads=3)) == (2, 3)
    # a synchronous trainer that takes whole batches never runs beside the rollouts
    assert threads(cfg(max_staleness=0, stream_trainer=False)) == threads(cfg(max_staleness=0, deterministic=True)) \
        == (5, 16)
    assert threads(cfg(max_staleness=0)) == (5, 6)  # streamed: beside the rollouts


def test_deterministic_run_over_http_pins_groups_to_versions_the_servers_keep(model_dir, tmp_path):
    with ServerProcess(model_dir, "--max-num-seqs", "16") as plain:
        cfg = TrainConfig.from_dict({**TINY, "model": model_dir, "run_dir": str(tmp_path / "a"), "steps": 2,
                                     "deterministic": True, "replica_urls": [plain.url]})
        with pytest.raises(ValueError, match="--keep-weight-versions 2"):
            train(cfg)
    with ServerProcess(model_dir, "--max-num-seqs", "16", "--keep-weight-versions", "2") as a:
        cfg = TrainConfig.from_dict({**TINY, "model": model_dir, "run_dir": str(tmp_path / "b"), "steps": 3,
                                     "deterministic": True, "replica_urls": [a.url]})
        report = train(cfg)
    assert report["policy_version"] == 3
    for g in read_log(Path(cfg.run_dir) / "groups.jsonl"):  # every turn under its group's pinned version
        assert g.admitted_version == max(0, g.seq // 2 - 1)
        assert {v for t in g.trajectories for v in t.policy_versions} <= {g.admitted_version}


@pytest.mark.parametrize("key,value,says", [
    ("lr", "abc", "'lr' takes float, got 'abc'"),  # (used to be found after the warm start)
    ("steps", 2.5, "'steps' takes int, got 2.5"),  # (used to run)
    ("deterministic", 1, "'deterministic' takes bool"),
    ("max_staleness", "x", "'max_staleness' takes int"),
    ("env_options", 5, "'env_options' takes dict"),
    ("tool_latency", [1, 2, 3], "'tool_latency' takes tuple[float, float]"),
    ("lora_targets", [1], "'lora_targets' takes str | list[str]"),
    ("exclude_statuses", "error", "'exclude_statuses' takes list[str]"),
    ("critic_model", 3, "'critic_model' takes str"),
    ("sft_file", 3, "'sft_file' takes str | None"),
])
def test_a_config_value_of_the_wrong_type_is_named_before_anything_runs(key, value, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        TrainConfig.from_dict({"model": "m", key: value})


def test_config_files_the_examples_and_what_is_missing(tmp_path):
    from rollwise.sim.run import SimConfig
    examples = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))
    assert len(examples) > 5
    for f in examples:  # every example's values are of their fields' types
        SimConfig.from_toml(f) if f.name.startswith("sim") else TrainConfig.from_toml(f, model="m")
    assert TrainConfig.from_dict({"model": "m", "lr": 1, "tool_latency": [0.1, 0.5]}).lr == 1  # an int is a float
    with pytest.raises(ValueError, match=re.escape("the config needs ['model']")):
        TrainConfig.from_dict({"lr": 1e-5})
    with pytest.raises(ValueError, match="cannot read config file"):
        TrainConfig.from_toml(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("lr = [\n")
    with pytest.raises(ValueError, match="is not TOML"):
        TrainConfig.from_toml(tmp_path / "bad.toml")
    with pytest.raises(ValueError, match="'replicas' takes int"):
        SimConfig.from_toml_text("replicas = 'four'")
