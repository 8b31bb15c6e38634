"""Rollout Routing Replay on a real tiny MoE: the trainer takes each token through the experts the
rollout engine routed it to."""
from __future__ import annotations

import pytest
import torch

from rollwise import LLM, SamplingParams
from rollwise.agent.envs import ENVS
from rollwise.agent.envs.calculator import CalculatorEnv
from rollwise.trainer.policy import Batch, PolicyModel
from rollwise.types import Trajectory
from rollwise.wire import encode_routing


def _rollouts(model_dir: str, weights: dict | None = None, n: int = 6) -> list[Trajectory]:
    llm = LLM(model_dir, seed=3, enable_return_routed_experts=True, kv_cache_gb=0.05)
    if weights is not None:
        llm.engine.update_weights(weights, 1)
    prompts = [[5 + i, 17, 300 + i, 42, 7, 9] for i in range(n)]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3,
                                                return_routed_experts=True))
    return [Trajectory(trajectory_id=str(i), group_id="g", task={}, token_ids=p + o.token_ids,
                       loss_mask=[0] * len(p) + [1] * len(o.token_ids), logprobs=[0.0] * len(p) + o.logprobs,
                       routed_experts={"shape": list(o.routed_experts.shape), "data": encode_routing(o.routed_experts)})
            for i, (p, o) in enumerate(zip(prompts, outs))]


def _diff(policy: PolicyModel, trajs: list[Trajectory], mode: str) -> float:
    policy.routing, policy.routing_stats = mode, torch.zeros(2)
    b = Batch.of(trajs)
    with torch.no_grad():
        lp = policy.logprobs(b)
    return float((lp - b.behaviour_logprobs).abs().mul(b.mask).sum() / b.mask.sum())


def test_same_weights_route_alike_and_replay_changes_nothing(model_dirs):
    d = model_dirs["qwen3_moe"]
    trajs = _rollouts(d)
    b = Batch.of(trajs)
    assert b.routing.shape == (6, b.input_ids.shape[1], 2, 2) and bool((b.routing[:, :-1] >= 0).all())
    policy = PolicyModel(d)
    off, replay = _diff(policy, trajs, "off"), _diff(policy, trajs, "replay")
    assert off < 1e-4 and replay < 1e-4
    moved, seen = policy.routing_stats.tolist()
    assert moved == 0 and seen > 0
    load = policy.expert_load[0]  # every known token-layer counted k times, once per expert it went to
    assert load.shape == (8,) and int(load.sum()) == 2 * int((b.routing[:, :, 0] >= 0).all(-1).sum())


def test_replay_takes_the_rollouts_experts_when_the_routers_disagree(model_dirs):
    """Rollouts from a replica whose routers differ a little from the trainer's (as bf16 rounding or
    a lagging replica would make them): some tokens go to other experts in the trainer, and their
    logprobs move far; replayed, every token takes the rollout's experts and the trainer's logprobs
    come much closer to the rollout's."""
    d = model_dirs["qwen3_moe"]
    policy = PolicyModel(d)
    w = policy.engine_weights()
    g = torch.Generator().manual_seed(0)
    for k in w:
        if k.endswith("mlp.gate.weight"):
            w[k] = w[k] + 0.05 * torch.randn(w[k].shape, generator=g)
    trajs = _rollouts(d, w)
    off = _diff(policy, trajs, "off")
    assert _diff(policy, trajs, "record") == pytest.approx(off)  # recording changes nothing...
    moved, seen = policy.routing_stats.tolist()
    assert moved > 0.02 * seen  # ...but shows the disagreement
    replay = _diff(policy, trajs, "replay")
    assert replay < 0.5 * off
    # gradients flow through the replayed experts' weights into the router
    policy.routing = "replay"
    b = Batch.of(trajs)
    (policy.logprobs(b) * b.mask).sum().backward()
    gates = [layer.mlp.gate.weight.grad for layer in policy.model.model.layers]
    assert all(gr is not None and float(gr.abs().sum()) > 0 for gr in gates)



class _ParityReward(CalculatorEnv):
    """Rewards an untrained model's answers half the time (by length), so every step trains."""

    def score(self, task: dict, answer: str) -> float:
        return float(len(answer) % 2)


def test_a_run_on_an_moe_model_replays_its_rollouts_routing(model_dirs, tmp_path, monkeypatch):
    """`rollwise train` with routing_replay: episodes keep their routing through the log, the trainer
    replays it (synchronous, so the replicas have the trainer's weights: no token routes otherwise), weights go back to
    the replicas each step, and a dense model is refused."""
    from rollwise.rl import TrainConfig, train
    from rollwise.rollout.pipeline import read_log
    monkeypatch.setitem(ENVS, "calculator", _ParityReward)
    d = model_dirs["qwen3_moe"]
    tiny = dict(env="calculator", sft_steps=2, sft_tasks=8, groups_per_step=2, group_size=2, max_tokens=12, max_turns=2,
                eval_tasks=2, max_num_seqs=16, progress=False, steps=2, routing_replay="replay", max_staleness=0)
    report = train(TrainConfig.from_dict({**tiny, "model": d, "run_dir": str(tmp_path / "run")}))
    assert len(report["steps"]) == 2
    for s in report["steps"]:
        assert s["trained_trajectories"] > 0 and s["routing_mismatch"] == 0.0 and s["logprob_diff"] < 1e-3
        assert 1.0 <= s["expert_load_max"] <= 8 / 2  # 8 experts, top 2
    for g in read_log(tmp_path / "run" / "groups.jsonl"):
        for t in g.trajectories:
            r = t.routing()
            assert r.shape[1:] == (2, 2) and len(t.token_ids) - 1 >= r.shape[0] >= t.turns[-1].start
    with pytest.raises(ValueError, match="needs a model with experts"):
        train(TrainConfig.from_dict({**tiny, "model": model_dirs["qwen3"], "run_dir": str(tmp_path / "dense")}))
    with pytest.raises(ValueError, match="valid.*off.*record.*replay"):
        TrainConfig.from_dict({**tiny, "model": d, "routing_replay": "yes"})
