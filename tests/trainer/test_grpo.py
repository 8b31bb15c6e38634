"""GRPO and SFT on a real tiny model (transformers for training, our engine for rollouts)."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rollwise import LLM, SamplingParams
from rollwise.agent.envs import make_env
from rollwise.rl import expert_trajectories
from rollwise.engine.tokenizer import Tokenizer
from rollwise.rl_config import TrainConfig
from rollwise.trainer.advantages import advantages, informative
from rollwise.trainer.grpo import GRPOConfig, GRPOTrainer, LogprobMismatch
from rollwise.trainer.sft import sft
from rollwise.trainer.stats import episode_stats
from rollwise.trainer.policy import Batch, PolicyModel
from rollwise.types import Trajectory, TurnRecord


def _sampled(model_dir: str, n: int, seed: int, version: int = 0, replica: str = "r0",
             weights: dict | None = None) -> list[Trajectory]:
    """Trajectories sampled by our engine at temperature 1 (logprobs are the engine's)."""
    llm = LLM(model_dir, seed=seed)
    if weights is not None:
        llm.engine.update_weights(weights, version)
    prompts = [[5 + i, 17, 300 + i, 42] for i in range(n)]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=seed))
    trajs = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        turn = TurnRecord(start=len(p), num_generated=len(o.token_ids), num_observation=0, finish_reason="length",
                          policy_version=o.policy_version, num_cached_tokens=0, generation_s=0, tool_s=0,
                          replica=replica)
        trajs.append(Trajectory(trajectory_id=f"t{i}", group_id=f"g{i // 2}", task={}, token_ids=p + o.token_ids,
                                loss_mask=[0] * len(p) + [1] * len(o.token_ids),
                                logprobs=[0.0] * len(p) + o.logprobs, turns=[turn], reward=float(i % 2)))
    return trajs


def test_advantages_are_group_relative():
    def t(r):
        return Trajectory(trajectory_id="x", group_id="g", task={}, reward=r)
    a = advantages([[t(1), t(0), t(0), t(1)], [t(1), t(1)]])
    assert a[:4] == pytest.approx([0.866, -0.866, -0.866, 0.866], abs=1e-3) and a[4:] == [0.0, 0.0]
    assert advantages([[t(2), t(0)]], "dr_grpo") == [1.0, -1.0]
    rewards = [0.5, 0.0, 1.0, 0.25, 1.0]  # RLOO: each reward minus the mean of the others
    loo = [r - (sum(rewards) - r) / (len(rewards) - 1) for r in rewards]
    assert advantages([[t(r) for r in rewards], [t(3)]], "rloo") == pytest.approx(loo + [0.0])
    # OPO: each reward minus the group's mean weighted by the episodes' generated tokens
    def sized(r, n):
        return Trajectory(trajectory_id="x", group_id="g", task={}, reward=r, loss_mask=[0] + [1] * n)
    group, sizes = [sized(1.0, 10), sized(0.0, 30), sized(1.0, 20), sized(0.5, 40)], [10, 30, 20, 40]
    base = sum(n * s.reward for n, s in zip(sizes, group)) / sum(sizes)  # 0.5: not the plain mean, 0.625
    assert advantages([group], "opo") == pytest.approx([s.reward - base for s in group])
    # Pass@k: the best episode alone, its reward over the second best's, divided by the group's std
    assert advantages([[t(0.2), t(0.9), t(0.5), t(0.9)]], "grpo_passk") == [0.0] * 4  # (a tie: none better)
    assert advantages([[t(0.2), t(0.9), t(0.5), t(0.7)]], "grpo_passk") == pytest.approx(
        [0.0, 0.2 / torch.tensor([0.2, 0.9, 0.5, 0.7]).std().item(), 0.0, 0.0], rel=1e-5)  # (std + 1e-6)
    assert advantages([[t(1.0)]], "grpo_passk") == [0.0]
    # ReMax: each reward minus the group's greedy episode's (a group of one trains; equal rewards may too)
    def based(r, b):
        return Trajectory(trajectory_id="x", group_id="g", task={}, reward=r, baseline=b)
    assert advantages([[based(1.0, 0.25), based(0.0, 0.25)], [based(1.0, 0.0)]], "remax") == [0.75, -0.25, 1.0]
    assert informative([based(1.0, 0.0), based(1.0, 0.0)], "remax") and not informative([based(1.0, 1.0)], "remax")
    with pytest.raises(ValueError, match="greedy episode"):
        advantages([[t(1.0)]], "remax")
    with pytest.raises(ValueError, match="valid.*grpo.*dr_grpo.*rloo.*opo.*grpo_passk"):
        advantages([[t(1)]], "ppo")
    with pytest.raises(ValueError, match="unknown advantage"):
        TrainConfig.from_dict({"model": "m", "advantage": "vtrace"})
    with pytest.raises(ValueError, match="critic"):  # gae's advantages are not the group's: critic.py
        advantages([[t(1)]], "gae")


def test_episode_stats_average_the_steps_episodes():
    def traj(status, turns, generated, **stats):
        t = Trajectory(trajectory_id="t", group_id="g", task={}, loss_mask=[0, 0] + [1] * generated, status=status,
                       env_stats=stats)
        t.turns = [TurnRecord(start=2, num_generated=0, num_observation=0, finish_reason="stop", policy_version=0,
                              num_cached_tokens=0, generation_s=0.0, tool_s=0.0)] * turns
        return t
    got = episode_stats([traj("done", 1, 4, calls=2.0), traj("max_turns", 3, 8, calls=1.0, call_errors=1.0),
                         traj("timeout", 2, 0), traj("max_turns", 2, 4)])
    assert got == {"turns": 2.0, "generated_per_episode": 4.0, "status_max_turns": 0.5, "status_timeout": 0.25,
                   "env_call_errors": 0.25, "env_calls": 0.75}


def test_trainer_logprobs_match_the_engine(model_dir):
    trajs = _sampled(model_dir, 4, seed=1)
    lp = PolicyModel(model_dir).logprobs(Batch.of(trajs)).detach()
    b = Batch.of(trajs)
    assert (lp - b.behaviour_logprobs).mul(b.mask).abs().max() < 1e-3


def test_grpo_step_moves_probability_toward_rewarded_samples(model_dir):
    trajs = _sampled(model_dir, 8, seed=2)
    policy = PolicyModel(model_dir)
    trainer = GRPOTrainer(policy, GRPOConfig(lr=5e-3))
    groups = [trajs[i:i + 2] for i in range(0, 8, 2)]  # rewards 0, 1 in every group
    before = policy.logprobs(Batch.of(trajs)).detach()
    m = trainer.step(groups)
    after = policy.logprobs(Batch.of(trajs)).detach()
    b = Batch.of(trajs)
    gain = ((after - before) * b.mask).sum(1)
    assert all(gain[i] > 0 for i in range(1, 8, 2)) and all(gain[i] < 0 for i in range(0, 8, 2))
    assert trainer.version == 1 and m["logprob_diff"] < 1e-3 and m["trained_trajectories"] == 8
    assert m["max_staleness"] == 0 and m["reward"] == 0.5


def test_an_update_whose_gradients_are_not_finite_is_dropped_and_training_goes_on(model_dir):
    """A NaN gradient (an overflow, say; here one parameter's, made so) makes the global norm NaN: the
    update is skipped, so the weights stay as they were (not NaN), the step says so, and the next
    step trains. (A NaN reward never gets this far: its group is not informative.)"""
    trajs = _sampled(model_dir, 8, seed=2)
    policy = PolicyModel(model_dir)
    trainer = GRPOTrainer(policy, GRPOConfig(lr=5e-3))
    before = _weights(policy)
    hook = next(iter(policy.parameters())).register_hook(lambda g: torch.full_like(g, math.nan))
    m = trainer.step([trajs[i:i + 2] for i in range(0, 8, 2)])
    hook.remove()
    assert m["skipped_updates"] == 1 and math.isnan(m["grad_norm"]) and trainer.version == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(policy)))
    m = trainer.step([trajs[i:i + 2] for i in range(0, 8, 2)])
    after = _weights(policy)
    assert m["skipped_updates"] == 0 and math.isfinite(m["grad_norm"]) and trainer.version == 2
    assert all(torch.isfinite(a).all() for a in after) and not all(torch.equal(a, b) for a, b in zip(before, after))


def test_logprob_check_flags_a_replica_on_other_weights(model_dir):
    policy = PolicyModel(model_dir)
    trainer = GRPOTrainer(policy, GRPOConfig())
    # a replica that claims version 0 (the trainer's) but serves other weights
    w = {k: v + 0.05 * torch.randn_like(v) for k, v in policy.engine_weights().items()}
    bad = _sampled(model_dir, 4, seed=3, version=0, replica="replica-b", weights=w)
    good = _sampled(model_dir, 4, seed=4, replica="replica-a")
    with pytest.raises(LogprobMismatch, match="replica-b"):
        trainer.step([good[:2], good[2:], bad[:2], bad[2:]])
    # stale samples (an older version) are not checked, they are importance-weighted
    for t in bad:
        t.turns[0].policy_version = -1
    m = trainer.step([good[:2], good[2:], bad[:2], bad[2:]])
    assert m["stale_trajectories"] == 4 and m["max_staleness"] == 1


def test_sft_on_expert_transcripts_lowers_the_loss(model_dir):
    tok = Tokenizer(model_dir)
    env = make_env("calculator")
    demos = asyncio.run(expert_trajectories(tok, lambda: make_env("calculator"), env.sample_tasks(16, seed=0)))
    assert all(t.reward == 1.0 and sum(t.loss_mask) > 0 for t in demos)
    losses = sft(PolicyModel(model_dir), demos, steps=30, lr=3e-3, batch_size=8)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_sft_in_micro_batches_takes_the_whole_batch_step(model_dir):
    """`micro_batch_tokens`: a batch too big for one forward runs in parts, gradients accumulated
    (the same loss and weights up to the order of the sums); a batch that fits runs whole, as before."""
    tok = Tokenizer(model_dir)
    env = make_env("calculator")
    demos = asyncio.run(expert_trajectories(tok, lambda: make_env("calculator"), env.sample_tasks(8, seed=1)))
    longest = max(len(t.token_ids) for t in demos)
    runs, forwards = {}, {}
    for micro in (None, 2 * longest, 100 * longest):  # whole; parts of at most 2 rows; fits: whole
        policy = PolicyModel(model_dir)
        rows = forwards[micro] = []
        forward = policy.logprobs
        policy.logprobs = lambda b, *a, **kw: rows.append(b.input_ids.shape[0]) or forward(b, *a, **kw)
        runs[micro] = (sft(policy, demos, steps=3, lr=3e-3, batch_size=6, micro_batch_tokens=micro),
                       torch.cat([p.detach().reshape(-1) for p in policy.model.parameters()]))
    (whole, w), (parts, wp), (fits, wf) = runs.values()
    assert forwards[None] == forwards[100 * longest] == [6, 6, 6]
    assert len(forwards[2 * longest]) >= 9 and max(forwards[2 * longest]) <= 2 and sum(forwards[2 * longest]) == 18
    assert parts == pytest.approx(whole, rel=1e-5) and (wp - w).abs().max() < 1e-5
    assert fits == whole and torch.equal(wf, w)


def test_shared_prefix_forward_is_exact(model_dir):
    """Running the batch's common prompt once (KV shared) gives the same logprobs and gradients."""
    tok = Tokenizer(model_dir)
    env = make_env("calculator")
    demos = asyncio.run(expert_trajectories(tok, lambda: make_env("calculator"), env.sample_tasks(6, seed=3)))
    b = Batch.of(demos)
    assert b.shared > 100  # the system prompt and tool schemas
    policy = PolicyModel(model_dir)
    grads = []
    for min_shared in (10**9, 32):
        policy.model.zero_grad()
        lp = policy.logprobs(b, min_shared=min_shared)
        (-(lp * b.mask).sum()).backward()
        grads.append((lp.detach() * b.mask, [p.grad.clone() for p in policy.parameters()]))
    (a, ga), (c, gc) = grads
    assert torch.allclose(a, c, atol=1e-4)
    assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-3) for x, y in zip(ga, gc))


def test_expert_transcripts_come_in_task_order_whatever_finishes_first(model_dir):
    """The SFT set (and so a warm start) must not depend on which episode's tools return first."""
    tok = Tokenizer(model_dir)
    tasks = make_env("phonebook").sample_tasks(24, seed=5)
    runs = [asyncio.run(expert_trajectories(tok, lambda: make_env("phonebook"), tasks, 0.35, seed=0)) for _ in range(2)]
    assert [t.task["id"] for t in runs[0]] == [t["id"] for t in tasks]
    assert [t.token_ids for t in runs[0]] == [t.token_ids for t in runs[1]]


def _weights(policy: PolicyModel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.parameters()]


def test_recomputed_behaviour_makes_a_step_independent_of_the_replicas_numerics(model_dir):
    """The replicas' logprobs carry rounding noise (batch shapes, speculation); with the behaviour
    recomputed by the trainer a step on fresh samples gives the same weights bit for bit."""
    trajs = _sampled(model_dir, 8, seed=2)
    noisy = _sampled(model_dir, 8, seed=2)
    for t in noisy:
        t.logprobs = [x + 1e-4 * (i % 3 - 1) if m else x for i, (x, m) in enumerate(zip(t.logprobs, t.loss_mask))]
    for behaviour, same in (("recompute", True), ("rollout", False)):
        out = []
        for ts in (trajs, noisy):
            policy = PolicyModel(model_dir)
            GRPOTrainer(policy, GRPOConfig(lr=5e-3, behaviour=behaviour)).step([ts[i:i + 2] for i in range(0, 8, 2)])
            out.append(_weights(policy))
        assert all(torch.equal(a, b) for a, b in zip(*out)) == same, behaviour


def test_recomputed_behaviour_of_stale_samples_uses_the_weights_that_generated_them(model_dir):
    policy = PolicyModel(model_dir)
    trainer = GRPOTrainer(policy, GRPOConfig(lr=5e-3, behaviour="recompute", keep_versions=1))
    first, stale = _sampled(model_dir, 8, seed=2), _sampled(model_dir, 8, seed=3)  # both from version 0
    trainer.step([first[i:i + 2] for i in range(0, 8, 2)])  # now version 1: `stale` is one version old
    b = Batch.of(stale)
    with torch.no_grad():
        prox = policy.logprobs(b)
        ver, behaviour = trainer.snap.stale(stale, b, trainer.version, 1)
        v0 = PolicyModel(model_dir).logprobs(b)
    assert (ver[b.mask > 0] == 0).all()
    assert torch.equal(behaviour * b.mask, v0 * b.mask)  # version 0's weights, exactly
    assert not torch.allclose(prox * b.mask, v0 * b.mask)  # (the step did move them)
    assert (behaviour - b.behaviour_logprobs).mul(b.mask).abs().max() < 1e-3  # what the engine sampled with
    # a turn the weights changed under (partial rollout): each token is judged by its own version
    t = stale[0]
    t.turns[0].version_segments = [(0, 0), (3, 1)]
    assert t.turns[0].token_versions() == [0, 0, 0, 1, 1, 1, 1, 1]
    with torch.no_grad():
        ver, behaviour = trainer.snap.stale(stale, b, trainer.version, 1)
    s0 = t.turns[0].start - 1  # token j is target j - 1
    assert ver[0, s0:s0 + 8].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert torch.equal(behaviour[0, s0:s0 + 3], v0[0, s0:s0 + 3])
    t.turns[0].version_segments = []
    m = trainer.step([stale[i:i + 2] for i in range(0, 8, 2)])
    assert m["stale_trajectories"] == 8 and m["max_staleness"] == 1
    with pytest.raises(ValueError, match="keep_versions"):  # two versions old: not kept
        trainer.step([first[i:i + 2] for i in range(0, 8, 2)])
    with pytest.raises(ValueError, match="'rollout' or 'recompute'"):
        GRPOTrainer(policy, GRPOConfig(behaviour="engine"))


@pytest.mark.parametrize("cfg", [dict(), dict(loss_agg="sequence"), dict(epochs=2, kl_coef=0.1, micro_batch_tokens=30),
                                 dict(behaviour="recompute", keep_versions=1),
                                 dict(epochs=2, policy_loss="gspo", loss_agg="sequence", clip=3e-4, clip_high=4e-4),
                                 dict(epochs=2, policy_loss="cispo", clip_high=5.0),
                                 dict(advantage="opo"), dict(advantage="grpo_passk", kl_coef=0.1, kl_loss_type="k3+"),
                                 dict(epochs=2, policy_loss="gmpo", loss_agg="sequence", clip=0.4, clip_high=0.4),
                                 dict(policy_loss="gpg", advantage="dr_grpo"), dict(epochs=2, policy_loss="sapo")])
def test_a_streamed_step_equals_the_whole_batch_step(model_dir, cfg):
    """Groups added as they arrive (in any order, any number at a time) give the step the whole
    batch gives: the same metrics, and the same weights up to float summation order (AdamW's
    normalized update turns gradient rounding into differences ~1e-5 at lr 5e-3)."""
    trajs = _sampled(model_dir, 12, seed=2)
    for t in trajs[8:]:  # a group with equal rewards: no advantage, nothing to train on
        t.reward = 1.0
    groups = [trajs[i:i + 2] for i in range(0, 8, 2)] + [trajs[8:]]
    whole, streamed = PolicyModel(model_dir), PolicyModel(model_dir)
    a, b = GRPOTrainer(whole, GRPOConfig(lr=5e-3, **cfg)), GRPOTrainer(streamed, GRPOConfig(lr=5e-3, **cfg))
    for _ in range(2):  # the second step: stale samples
        ma = a.step(groups)
        b.begin()
        for chunk in ([groups[3]], [groups[4], groups[0]], groups[1:3]):
            b.add(chunk)
        mb = b.finish()
        assert a.version == b.version
        trained = 4 if cfg.get("advantage") == "grpo_passk" else 8  # (passk: the best of each pair alone)
        assert ma.keys() == mb.keys() and ma["trained_trajectories"] == mb["trained_trajectories"] == trained
        for k in ma:
            assert mb[k] == pytest.approx(ma[k], rel=1e-4, abs=1e-6, nan_ok=True), k
        assert all(torch.allclose(x, y, atol=1e-4) for x, y in zip(_weights(whole), _weights(streamed)))
    moved = max(float((x - y).abs().max()) for x, y in zip(_weights(whole), _weights(PolicyModel(model_dir))))
    assert moved > 5e-3  # two steps moved the weights far more than the tolerance


def test_a_streamed_step_checks_the_logprobs_before_updating(model_dir):
    policy = PolicyModel(model_dir)
    trainer = GRPOTrainer(policy, GRPOConfig())
    w = {k: v + 0.05 * torch.randn_like(v) for k, v in policy.engine_weights().items()}
    bad = _sampled(model_dir, 4, seed=3, version=0, replica="replica-b", weights=w)
    before = _weights(policy)
    with pytest.raises(RuntimeError, match="begin"):
        trainer.add([bad[:2]])
    trainer.begin()
    trainer.add([bad[:2]])
    trainer.add([bad[2:]])
    with pytest.raises(LogprobMismatch, match="replica-b"):
        trainer.finish()
    assert trainer.version == 0 and all(torch.equal(x, y) for x, y in zip(before, _weights(policy)))
    assert all(p.grad is None for p in policy.parameters())


def test_clip_higher_lets_a_rewarded_token_rise_past_the_symmetric_clip(model_dir):
    """Ratio 1.25 on a token with positive advantage: clipped (no gradient) at clip 0.2, not with
    DAPO's clip_high 0.28; on the negative side both clip at 1 - 0.2."""
    trajs = _sampled(model_dir, 2, seed=4)
    b = Batch.of(trajs)
    prox = b.behaviour_logprobs.clone()
    grads = {}
    for clip_high in (None, 0.28):
        trainer = GRPOTrainer(PolicyModel(model_dir), GRPOConfig(clip=0.2, clip_high=clip_high))
        for sign, shift in ((1.0, 1.25), (-1.0, 0.75)):
            lp = (prox + torch.log(torch.tensor(shift))).requires_grad_()
            trainer._backward(lp, b, torch.tensor([sign, sign]), None, prox, 1.0, torch.zeros(6))
            grads[clip_high, sign] = float(lp.grad.abs().sum())
    assert grads[None, 1.0] == 0.0 and grads[0.28, 1.0] > 0  # clip-higher keeps the gradient
    assert grads[None, -1.0] == 0.0 and grads[0.28, -1.0] == 0.0  # the lower clip is unchanged
    assert GRPOConfig(clip=0.2, clip_high=0.28).clip_range == (0.8, 1.28)


def test_excluded_statuses_carry_no_loss_and_entropy_is_reported(model_dir):
    trajs = _sampled(model_dir, 8, seed=5)
    for t in trajs[:2]:
        t.status = "max_context"  # cut off by the context limit
    groups = [trajs[i:i + 2] for i in range(0, 8, 2)]
    policy = PolicyModel(model_dir)
    b = Batch.of(trajs[2:])
    with torch.no_grad():  # the sampling distribution's entropy at the trained tokens, by hand
        logits = policy.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1)
        want = float((-(logp.exp() * logp).sum(-1) * b.mask).sum() / b.mask.sum())
    m = GRPOTrainer(policy, GRPOConfig(exclude_statuses=("max_context", "timeout"))).step(groups)
    assert m["trained_trajectories"] == 6 and m["trained_tokens"] == int(b.mask.sum())
    assert m["entropy"] == pytest.approx(want, rel=1e-4)
    with pytest.raises(ValueError, match=r"valid statuses are \['max_turns', 'max_context', 'timeout', 'error'\]"):
        GRPOTrainer(policy, GRPOConfig(exclude_statuses=("truncated",)))


def test_constant_loss_agg_sums_each_trajectory_over_a_fixed_count(model_dir):
    """Dr. GRPO's aggregation: sum(token losses) / C per trajectory, then the mean over trajectories;
    at ratio 1 (fresh samples) each token's loss is -A, so the loss is -sum(A_i n_i) / (C N)."""
    trajs = _sampled(model_dir, 8, seed=7)
    for i, t in enumerate(trajs):  # answers of 2 to 8 tokens (8 each as sampled)
        k = len(t.token_ids) - 8 + 2 + (i * 5) % 7
        t.token_ids, t.loss_mask, t.logprobs = t.token_ids[:k], t.loss_mask[:k], t.logprobs[:k]
        t.turns[0].num_generated = k - t.turns[0].start
    groups = [trajs[i:i + 4] for i in range(0, 8, 4)]
    adv = advantages(groups)
    useful = [(a, t.num_generated) for a, t in zip(adv, trajs) if abs(a) > 1e-9]
    loss = {c: GRPOTrainer(PolicyModel(model_dir), GRPOConfig(loss_agg="constant", loss_scale_tokens=c)).step(groups)
            ["loss"] for c in (40, 80)}
    want = -sum(a * n for a, n in useful) / (40 * len(useful))
    assert abs(want) > 1e-3 and loss[40] == pytest.approx(want, rel=1e-3)
    assert loss[40] == pytest.approx(2 * loss[80], rel=1e-5)
    with pytest.raises(ValueError, match="loss_scale_tokens"):
        GRPOTrainer(PolicyModel(model_dir), GRPOConfig(loss_agg="constant"))
    with pytest.raises(ValueError, match="valid.*constant"):
        TrainConfig.from_dict({"model": "m", "loss_agg": "mean"})
    assert TrainConfig.from_dict({"model": "m", "loss_agg": "constant"}).loss_scale_tokens == 0  # max_tokens x turns
    # verl's names: seq-mean-token-sum is the sum over each trajectory's tokens (over 1), then the mean
    summed = GRPOTrainer(PolicyModel(model_dir), GRPOConfig(loss_agg="seq-mean-token-sum", loss_scale_tokens=40))
    assert (summed.cfg.loss_agg, summed.cfg.loss_scale_tokens) == ("constant", 1)
    assert summed.step(groups)["loss"] == pytest.approx(40 * want, rel=1e-3)
    rl = TrainConfig.from_dict({"model": "m", "loss_agg": "seq-mean-token-sum-norm", "max_tokens": 10, "max_turns": 3})
    assert (rl.trainer_config().loss_agg, rl.trainer_config().loss_scale_tokens) == ("constant", 30)
    assert GRPOConfig(loss_agg="seq-mean-token-mean").loss_agg == "sequence"
    assert GRPOConfig(loss_agg="token-mean").loss_agg == "token"


@pytest.mark.parametrize("loss_agg", ["token", "sequence"])
def test_mini_batches_take_an_optimizer_step_per_part(model_dir, loss_agg):
    trajs = _sampled(model_dir, 8, seed=9)
    groups = [trajs[i:i + 2] for i in range(0, 8, 2)]
    out = {}
    for k, mbt in ((1, 8192), (2, 8192), (1, 24), (2, 24)):  # micro-batches of 24 tokens: 2 rows each
        policy = PolicyModel(model_dir)
        trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-2, mini_batches=k, micro_batch_tokens=mbt, loss_agg=loss_agg))
        m = trainer.step(groups)
        steps = {int(st["step"]) for st in trainer.opt.state.values()}
        out[k, mbt] = (m, steps, torch.cat([p.detach().flatten() for p in policy.parameters()]))
    # one micro-batch: a single part, so the deferred update is the same as the first pass's, bit for bit
    assert out[2, 8192][1] == {1} and torch.equal(out[1, 8192][2], out[2, 8192][2])
    assert out[1, 8192][0]["loss"] == pytest.approx(out[2, 8192][0]["loss"], rel=1e-6)
    # four micro-batches: two parts, two optimizer steps; the second part's ratios moved off 1
    assert out[1, 24][1] == {1} and out[2, 24][1] == {2}
    assert not torch.equal(out[1, 24][2], out[2, 24][2])
    assert out[2, 24][0]["logprob_diff"] < 1e-3 and out[2, 24][0]["trained_trajectories"] == 8
    with pytest.raises(ValueError, match="mini_batches"):
        TrainConfig.from_dict({"model": "m", "mini_batches": 0})


def test_the_learning_rate_follows_its_schedule(model_dir):
    from rollwise.trainer.schedule import lr_factor
    assert [lr_factor(s, warmup=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, 2, "cosine", total=10, min_ratio=0.1) for s in (0, 2, 6, 10, 12)]
    assert cos == pytest.approx([0.5, 1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1])
    trajs = _sampled(model_dir, 4, seed=8)
    trainer = GRPOTrainer(PolicyModel(model_dir), GRPOConfig(lr=1e-3, lr_warmup_steps=2, lr_schedule="cosine",
                                                             total_steps=4, min_lr_ratio=0.5))
    lrs = []
    for _ in range(4):  # (stale samples after the first step: their importance weights take them)
        lrs.append((trainer.step([trajs[:2], trajs[2:]])["lr"], trainer.opt.param_groups[0]["lr"]))
    assert [a for a, _ in lrs] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3 * (0.5 + 0.5 * 0.5)])
    assert all(a == b for a, b in lrs)
    with pytest.raises(ValueError, match="valid.*cosine"):
        TrainConfig.from_dict({"model": "m", "lr_schedule": "linear"})


def test_an_entropy_bonus_raises_the_policys_entropy(model_dir):
    trajs = _sampled(model_dir, 8, seed=6)
    groups = [trajs[i:i + 2] for i in range(0, 8, 2)]
    entropy = {}
    for coef in (0.0, 0.5):
        policy = PolicyModel(model_dir)
        trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-2, entropy_coef=coef, epochs=2))
        m = trainer.step(groups)
        assert m["trained_trajectories"] > 0
        ent: list = []
        policy.logprobs(Batch.of(trajs), entropy=ent)
        b = Batch.of(trajs)
        entropy[coef] = (m["entropy"], float((ent[0].detach() * b.mask).sum() / b.mask.sum()))
    assert entropy[0.0][0] == entropy[0.5][0]  # the step's metric: the entropy before its update
    assert entropy[0.5][1] > entropy[0.0][1] + 0.05  # the bonus raised it (two epochs of it)


def _episode(*contexts: Trajectory, reward: float) -> Trajectory:
    """An episode that ran in several contexts (the last one's fields, the others `earlier`)."""
    last = contexts[-1]
    return Trajectory(trajectory_id=last.trajectory_id, group_id="g", task={}, token_ids=last.token_ids,
                      loss_mask=last.loss_mask, logprobs=last.logprobs, turns=last.turns, reward=reward,
                      earlier=list(contexts[:-1]))


def test_each_context_of_an_episode_is_trained_with_the_episodes_advantage(model_dir):
    """token loss: an episode of two contexts has the gradient its two sequences would have, each
    with the episode's advantage; sequence loss: its contexts are averaged as one episode (not as two)."""
    s1, s2, f, _ = _sampled(model_dir, 4, seed=9)
    empty = Trajectory(trajectory_id="z", group_id="g", task={}, reward=0.0)  # no tokens: no loss

    def grads(cfg: GRPOConfig, groups, **totals) -> list[torch.Tensor]:
        policy = PolicyModel(model_dir)
        trainer = GRPOTrainer(policy, cfg)
        trainer.begin(**totals)
        trainer.add(groups)
        return [p.grad.clone() for p in policy.parameters()]

    def same(a, b):
        return all(torch.allclose(x, y, rtol=1e-4, atol=1e-7) for x, y in zip(a, b))

    token = GRPOConfig()
    one = grads(token, [[_episode(s1, s2, reward=1.0), _episode(f, reward=0.0)]], n_tokens=24)
    two = grads(token, [[_episode(s1, reward=1.0), _episode(f, reward=0.0)], [_episode(s2, reward=1.0), empty]],
                n_tokens=24)
    assert same(one, two) and max(float(g.abs().max()) for g in one) > 1e-3
    # sequence loss of [E (16 tokens), F (8)] = token loss of [E, F twice (16)]: (sum_E + 2 sum_F) / 32
    seq = grads(GRPOConfig(loss_agg="sequence"), [[_episode(s1, s2, reward=1.0), _episode(f, reward=0.0)]],
                n_trajectories=2)
    tok = grads(token, [[_episode(s1, s2, reward=1.0), _episode(f, f, reward=0.0)]], n_tokens=32)
    assert same(seq, tok) and not same(seq, one)
    m = GRPOTrainer(PolicyModel(model_dir), token).step([[_episode(s1, s2, reward=1.0), _episode(f, reward=0.0)]])
    assert m["trained_tokens"] == 24 and m["trained_trajectories"] == 2 and m["contexts"] == 1.5


def test_sft_trains_every_context_of_an_expert_episode(model_dir):
    s1, s2 = _sampled(model_dir, 2, seed=3)
    policy = PolicyModel(model_dir)
    losses = sft(policy, [_episode(s1, s2, reward=1.0)], steps=30, lr=1e-2, batch_size=2, warmup=1)
    lp = policy.logprobs(Batch.of([s1, s2])).detach()
    assert losses[-1] < 0.5 * losses[0] and (lp * Batch.of([s1, s2]).mask).sum(1).max() > -4.0  # both learnt


def test_lora_starts_as_the_model_trains_adapters_alone_and_merges_exactly(model_dir, tmp_path):
    trajs = _sampled(model_dir, 2, seed=3)
    b = Batch.of(trajs)
    policy = PolicyModel(model_dir)
    before = policy.logprobs(b).detach()
    weights = {k: v.clone() for k, v in policy.model.state_dict().items()}
    policy.add_lora(4, 8, ["q_proj", "v_proj"])
    assert torch.equal(policy.logprobs(b).detach(), before)  # B = 0: the model as it was
    names = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n and ("q_proj" in n or "v_proj" in n) for n in names)
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-2, kl_coef=0.1))
    assert trainer.snap.ref is None  # the KL reference is the policy with its adapters off: no copy
    for t in trajs:
        t.reward = float(t.trajectory_id.endswith("0"))
    assert trainer.step([trajs])["kl"] == pytest.approx(0.0, abs=1e-9)  # the adapters start at zero
    assert trainer.step([trajs])["kl"] > 0 and all(m.merged is False for _, m in policy._lora_layers())
    with policy.adapters_off():
        assert torch.allclose(policy.logprobs(b).detach(), before, atol=1e-6)  # off: the warm start again
    after = policy.logprobs(b).detach()
    assert not torch.equal(after, before)
    changed = policy.engine_weights(changed_only=True)
    assert sorted({k.split(".")[-2] for k in changed}) == ["q_proj", "v_proj"]
    full = policy.engine_weights()
    assert full.keys() == weights.keys()
    assert all(torch.equal(full[k], weights[k]) for k in full if k not in changed)
    fresh = PolicyModel(model_dir)
    fresh.model.load_state_dict(full)  # what a replica serves: the same logprobs
    assert torch.allclose(fresh.logprobs(b).detach(), after, atol=1e-5)
    with pytest.raises(ValueError, match="already"):
        policy.add_lora(4, 8)
    with pytest.raises(ValueError, match="nope.*not found"):
        PolicyModel(model_dir).add_lora(4, 8, ["nope"])


def test_the_kl_reference_runs_once_per_micro_batch_whatever_the_epochs(model_dir):
    trajs = _sampled(model_dir, 4, seed=5)
    for t in trajs:
        t.reward = float(t.trajectory_id.endswith(("0", "1")))
    runs, metrics = {}, {}
    for epochs in (1, 3):
        policy = PolicyModel(model_dir)
        trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-2, kl_coef=0.1, epochs=epochs, micro_batch_tokens=40))
        calls, swap = [], trainer.snap.swap
        trainer.snap.swap = lambda w: (calls.append(1), swap(w))[1]  # the reference's weights swapped in
        metrics[epochs] = trainer.step([trajs])
        runs[epochs] = len(calls)
    assert runs[1] == runs[3] >= 2  # one reference forward per micro-batch, not per epoch
    assert metrics[3]["kl"] > 0 == metrics[1]["kl"]  # (the last epoch's KL: the policy moved off the reference)


def test_kl_in_the_loss_and_in_the_reward_share_the_reference_forward(model_dir):
    trajs = _sampled(model_dir, 4, seed=5)
    for t in trajs:
        t.reward = float(t.trajectory_id.endswith(("0", "1")))
    runs = {}
    for name, kl in {"reward": {}, "both": {"kl_coef": 0.1}}.items():
        trainer = GRPOTrainer(PolicyModel(model_dir), GRPOConfig(lr=1e-2, reward_kl_coef=0.1, epochs=2,
                                                                 micro_batch_tokens=40, **kl))
        calls, swap = [], trainer.snap.swap
        trainer.snap.swap = lambda w: (calls.append(1), swap(w))[1]
        ms = [trainer.step([trajs]) for _ in range(2)]
        runs[name] = len(calls)
    assert runs["both"] == runs["reward"] >= 4  # the loss's KL takes the reward's reference rows
    assert ms[1]["kl"] > 0 and ms[1]["reward_kl"] > 0
    # rows valued in one micro-batch, assembled for another: its own forward's values, without a forward
    snap = trainer.snap
    whole = snap.reference(trajs, Batch.of(trajs))
    n = len(calls)
    part = Batch.of(trajs[2:])
    got = snap.reference(trajs[2:], part)
    assert len(calls) == n and got.shape == part.targets.shape
    with torch.no_grad(), snap.swap({k: p.data for k, p in snap.ref.named_parameters()}):
        own = trainer.policy.logprobs(part)
    assert torch.allclose(got * part.mask, own * part.mask, atol=1e-5)
    assert torch.equal(got[0, :len(trajs[2].token_ids) - 1], whole[2, :len(trajs[2].token_ids) - 1])


def test_dual_clip_bounds_a_negative_advantages_loss(model_dir):
    """Dual-clip PPO: a token whose ratio went far up (4.5 here) under a negative advantage has loss
    at most dual_clip x |A| (and no gradient there); a positive advantage's is the ordinary clip."""
    mask = torch.ones(2, 2)
    prox = torch.full((2, 2), -1.0)
    lp0 = prox + torch.tensor([[1.5, 0.0], [1.5, 0.0]])  # first tokens: ratio e^1.5 = 4.48
    b = Batch(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long),
              targets=torch.zeros(2, 2, dtype=torch.long), mask=mask, behaviour_logprobs=prox)
    a = torch.tensor([-0.5, 1.0])
    out = {}
    for dual in (0.0, 3.0):
        trainer = GRPOTrainer(PolicyModel(model_dir), GRPOConfig(clip=0.2, dual_clip=dual))
        lp = lp0.clone().requires_grad_()
        stats = torch.zeros(6)
        trainer._backward(lp, b, a, None, prox, div=1.0, stats=stats)
        out[dual] = (float(stats[0]), lp.grad.clone())
    r = float(torch.exp(torch.tensor(1.5)))
    # token (0, 0): 0.5 r unbounded, 3 x 0.5 dual-clipped; (0, 1): ratio 1, loss 0.5; row 1: -1.2 (clipped) and -1
    assert out[0.0][0] == pytest.approx(0.5 * r + 0.5 - 1.2 - 1.0, rel=1e-6)
    assert out[3.0][0] == pytest.approx(1.5 + 0.5 - 1.2 - 1.0, rel=1e-6)
    assert out[0.0][1][0, 0] == pytest.approx(0.5 * r) and out[3.0][1][0, 0] == 0.0
    assert torch.equal(out[0.0][1][1], out[3.0][1][1]) and torch.equal(out[0.0][1][0, 1:], out[3.0][1][0, 1:])
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        GRPOTrainer(PolicyModel(model_dir), GRPOConfig(dual_clip=0.5))


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo", "gmpo", "gpg", "sapo"])
def test_policy_losses_against_their_formulas(model_dir, policy_loss):
    """Each loss on made-up logprobs, its value and gradient against the formula written out:
    PPO clips each token's ratio, GSPO the sequence's geometric mean (each token's gradient the
    sequence ratio times its own), CISPO weights each token's logprob by its clipped, stopped ratio,
    GMPO takes the geometric mean of token ratios each clipped in log space against its advantage,
    SAPO gates each ratio by a sigmoid whose temperature its advantage's sign picks."""
    torch.manual_seed(0)
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 0, 1, 1]])
    prox = -torch.rand(2, 4) * 2
    lp0 = prox + torch.tensor([[0.0, 0.3, -0.2, 0.05], [0, 0, 0.01, -0.4]])  # as after an update
    behav = prox - 0.1 * torch.rand(2, 4)
    b = Batch(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.long),
              targets=torch.zeros(2, 4, dtype=torch.long), mask=mask, behaviour_logprobs=behav)
    a = torch.tensor([1.5, -0.5])
    cfg = GRPOConfig(policy_loss=policy_loss, clip=0.1, clip_high=0.15, tis_cap=2.0)
    trainer = GRPOTrainer(PolicyModel(model_dir), cfg)
    lp = lp0.clone().requires_grad_()
    stats = torch.zeros(6)
    trainer._backward(lp, b, a, None, prox, div=5.0, stats=stats)

    w = torch.exp(prox - behav).clamp(max=2.0)
    A = a[:, None]
    if policy_loss == "gspo":  # one ratio per sequence
        r = torch.exp(((lp0 - prox) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)).expand(2, 4)
    else:
        r = torch.exp(lp0 - prox)
    c = r.clamp(0.9, 1.15)
    if policy_loss == "cispo":  # -sg(clip(r)) A w logp
        grad, value = -c * A * w, -c * A * w * lp0
    elif policy_loss == "gpg":  # -A w logp: no ratio, nothing clipped
        grad, value = -A * w, -A * w * lp0
    elif policy_loss == "sapo":  # -A w (4 / tau)(sigmoid(tau (r - 1)) - 1/2), tau 1.0 for row 0 (A > 0), 1.05 for row 1
        tau = torch.tensor([[1.0], [1.05]])
        s = torch.sigmoid(tau * (r - 1))
        grad, value = -A * w * 4 * s * (1 - s) * r, -A * w * (4 / tau) * (s - 0.5)
    elif policy_loss == "gmpo":  # row 0 (A > 0): log-ratios over log 1.15 held there; row 1 (A < 0): under log 0.9
        d = lp0 - prox
        kept = torch.tensor([[True, False, True, True], [True, True, True, False]])  # (0.3 > 0.14, -0.4 < -0.105)
        held = torch.where(kept, d, torch.tensor([[0.0, math.log(1.15), 0, 0], [0, 0, 0, math.log(0.9)]]))
        seq = torch.exp((held * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True))
        grad, value = -seq * A * w * kept, -seq * A * w
    else:  # -min(r A, clip(r) A) w: the gradient flows where the unclipped term is the min
        grad, value = -(r * A) * (r * A <= c * A).float() * w, -torch.minimum(r * A, c * A) * w
    assert torch.allclose(lp.grad, grad * mask / 5.0, atol=1e-6)
    assert float(stats[0]) == pytest.approx(float((value * mask).sum() / 5.0), abs=1e-6)
    if policy_loss in ("ppo", "gspo"):  # row 1 moved outside the range against its advantage: clipped, no gradient
        assert (lp.grad[1] == 0).all() == (policy_loss == "gspo") and (lp.grad[0] != 0).any()
    if policy_loss == "gpg":
        assert float(stats[1]) == 0 and (lp.grad[mask.bool()] != 0).all()
    if policy_loss == "gmpo":  # the clipped tokens alone carry no gradient
        assert lp.grad[0, 1] == 0 and lp.grad[1, 3] == 0 and (lp.grad[0, 2:] != 0).all() and lp.grad[1, 2] != 0
    if policy_loss == "sapo":  # no clip: every token keeps a gradient (PPO's is 0 at row 0's token 1)
        assert (lp.grad[mask.bool()] != 0).all()
    valid = "valid: \\['ppo', 'gspo', 'cispo', 'clip_cov', 'kl_cov', 'gmpo', 'gpg', 'sapo'\\]"
    with pytest.raises(ValueError, match=valid):
        GRPOTrainer(PolicyModel(model_dir), GRPOConfig(policy_loss="dpo"))


def test_sapo_gate_is_ppo_at_ratio_1_and_fades_far_off():
    """SAPO's gradient at ratio 1 is PPO's (-A w per logprob, whatever tau) and its value 0 there; far
    off (log-ratio past 20 either way) it is 0, finite, where an unclamped ratio gives 0 x inf; a
    negative advantage's gate (tau_neg > tau_pos) falls off faster than a positive one's."""
    from rollwise.trainer.losses import token_losses
    A = torch.tensor([[2.0], [-2.0]])
    w, mask = torch.full((2, 3), 0.5), torch.ones(2, 3)
    prox = torch.zeros(2, 3)
    for taus in ((1.0, 1.05), (0.3, 8.0)):
        lp = torch.zeros(2, 3, requires_grad=True)
        loss, ratio = token_losses("sapo", lp, prox, A, w, mask, (0.8, 1.2), sapo=taus)
        loss.sum().backward()
        assert torch.equal(ratio, torch.ones(2, 3)) and torch.equal(loss.detach(), torch.zeros(2, 3))
        assert torch.allclose(lp.grad, (-A * w).expand(2, 3))
    lp = torch.tensor([[30.0, -30.0, 0.7], [30.0, -30.0, 0.7]], requires_grad=True)
    token_losses("sapo", lp, prox, A, w, mask, (0.8, 1.2), sapo=(1.0, 3.0))[0].sum().backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[:, :2] == 0).all()
    assert abs(lp.grad[1, 2]) < abs(lp.grad[0, 2])  # the same ratio, |A| alike: tau 3 gates harder than tau 1


@pytest.mark.parametrize("policy_loss", ["clip_cov", "kl_cov"])
def test_covariance_losses_hold_back_the_tokens_that_covary_most(model_dir, policy_loss):
    """Clip-Cov: PPO's gradient, but none at k tokens drawn from those whose covariance term is in
    [lb, ub]; KL-Cov: the unclipped gradient, plus coef x |lp - prox| at the k tokens of largest
    covariance (k = cov_fraction x the micro-batch's generated tokens, at least 1)."""
    from rollwise.trainer.losses import covariance
    torch.manual_seed(0)
    mask = torch.tensor([[0.0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    prox = -torch.rand(3, 5) * 2
    lp0 = prox + 0.05 * torch.randn(3, 5)
    b = Batch(input_ids=torch.zeros(3, 6, dtype=torch.long), attention_mask=torch.ones(3, 6, dtype=torch.long),
              targets=torch.zeros(3, 5, dtype=torch.long), mask=mask, behaviour_logprobs=prox.clone())
    a = torch.tensor([2.0, -1.0, 0.5])
    cfg = GRPOConfig(policy_loss=policy_loss, clip=0.2, cov_fraction=0.25, clip_cov_lb=0.0, clip_cov_ub=10.0,
                     kl_cov_coef=2.0)
    trainer = GRPOTrainer(PolicyModel(model_dir), cfg)
    lp = lp0.clone().requires_grad_()
    trainer._backward(lp, b, a, None, prox, div=1.0, stats=torch.zeros(6))
    A = a[:, None].expand(3, 5)
    c = covariance(lp0, A, mask)
    r = torch.exp(lp0 - prox)
    k = int(0.25 * int(mask.sum()))  # 2 of the 11 generated tokens
    if policy_loss == "clip_cov":
        ppo = -(r * A) * (r * A <= r.clamp(0.8, 1.2) * A).float() * mask
        held = (lp.grad == 0) & (ppo != 0)
        assert int(held.sum()) == k and bool((c[held] >= 0).all())  # drawn among covariance in [0, 10]
        assert torch.allclose(lp.grad[~held], ppo[~held], atol=1e-6)
    else:
        top = torch.zeros(15, dtype=torch.bool)
        top[c.flatten().topk(k).indices] = True
        top = top.view(3, 5)
        want = (-r * A + 2.0 * torch.sign(lp0 - prox) * top.float()) * mask
        assert torch.allclose(lp.grad, want, atol=1e-6) and bool((c[top] >= c[mask.bool() & ~top].max()).all())
    with pytest.raises(ValueError, match="cov_fraction"):
        GRPOConfig(policy_loss=policy_loss, cov_fraction=0.0).check()
    with pytest.raises(ValueError, match="stream_whitened"):
        GRPOConfig(policy_loss=policy_loss, stream_whitened=True).check()


@pytest.mark.parametrize("policy_loss", ["clip_cov", "kl_cov"])
def test_covariance_losses_train_and_repeat(model_dir, policy_loss):
    """A step with Clip-Cov or KL-Cov moves the weights, and two trainers given the same batch end
    with the same weights (Clip-Cov's draw is seeded by the micro-batch and the version)."""
    trajs = _sampled(model_dir, 8, seed=3)
    groups = [trajs[i:i + 2] for i in range(0, 8, 2)]
    cfg = GRPOConfig(lr=5e-3, policy_loss=policy_loss, cov_fraction=0.05, clip_cov_lb=-10.0, micro_batch_tokens=60)
    runs = []
    for _ in range(2):
        policy = PolicyModel(model_dir)
        before = {k: v.clone() for k, v in policy.model.state_dict().items()}
        m = GRPOTrainer(policy, cfg).step(groups)
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values() if isinstance(v, float))
        runs.append(policy.model.state_dict())
    assert any(not torch.equal(before[k], runs[0][k]) for k in before)
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_kl_estimators_follow_their_formulas_and_the_plus_ones_take_k2s_gradient():
    from rollwise.trainer.losses import kl_estimate
    lp = torch.tensor([-1.0, -2.5, -0.1, -30.0], requires_grad=True)
    ref = torch.tensor([-1.5, -2.0, -0.1, -1.0])
    d = (lp - ref).detach()
    want = {"k1": d, "k2": 0.5 * d**2, "abs": d.abs(),
            "k3": torch.minimum(torch.exp(-d.clamp(-20, 20)) + d.clamp(-20, 20) - 1, torch.tensor(10.0))}
    assert want["k3"][3] == 10  # (held at 10, as verl's low_var_kl: e^29 otherwise)
    for kind, value in want.items():
        assert torch.allclose(kl_estimate(lp, ref, kind), value)
    for alias, kind in {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}.items():
        assert torch.equal(kl_estimate(lp, ref, alias), kl_estimate(lp, ref, kind))
    k2_grad = torch.autograd.grad(kl_estimate(lp, ref, "k2").sum(), lp)[0]
    for kind in ("k1+", "k3+", "abs+"):  # the estimator's value, k2's gradient (the KL's, in expectation)
        out = kl_estimate(lp, ref, kind)
        assert torch.allclose(out, want[kind[:-1]])
        assert torch.allclose(torch.autograd.grad(out.sum(), lp)[0], k2_grad)
    with pytest.raises(ValueError, match=r"unknown kl_loss_type 'k4'; valid: \['k1', 'k2', 'k3'"):
        kl_estimate(lp, ref, "k4")
    with pytest.raises(ValueError, match="unknown kl_loss_type 'k4'"):
        TrainConfig.from_dict({"model": "m", "kl_loss_type": "k4"})


def test_the_kl_loss_type_chooses_the_gradient(model_dir):
    """At the reference (step 1) k2's and k3's gradients are zero and k1's is not; once the policy
    moved (step 2) the "+" estimators take k2's gradient, and k3 its own. The step metric `kl` is
    k3's whichever the loss takes."""
    trajs = _sampled(model_dir, 4, seed=5)
    for t in trajs:
        t.reward = float(t.trajectory_id.endswith(("0", "1")))
    norms, kls = {}, {}
    for kind in ("k1", "k2", "k3", "k1+", "k3+"):
        trainer = GRPOTrainer(PolicyModel(model_dir), GRPOConfig(lr=1e-2, kl_coef=1.0, kl_loss_type=kind))
        ms = [trainer.step([trajs]) for _ in range(2)]
        norms[kind], kls[kind] = [m["grad_norm"] for m in ms], ms[1]["kl"]
    for kind in ("k3", "k1+", "k3+"):
        assert norms[kind][0] == pytest.approx(norms["k2"][0], rel=1e-6)
    assert abs(norms["k1"][0] - norms["k2"][0]) > 1e-3 * norms["k2"][0]
    for kind in ("k1+", "k3+"):
        assert norms[kind][1] == pytest.approx(norms["k2"][1], rel=1e-5)
        assert kls[kind] == pytest.approx(kls["k2"], rel=1e-5) and kls[kind] > 0
    assert abs(norms["k3"][1] - norms["k2"][1]) > 0.1 * norms["k2"][1]  # (lr 1e-2: far off the reference)
