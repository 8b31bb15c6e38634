"""PPO's critic and GAE (`advantage = "gae"`, rollwise/trainer/critic.py) and REINFORCE++: the
formulas on hand-built episodes, where the advantages land in a batch, and steps on a real tiny model."""
from __future__ import annotations

import pytest
import torch

from rollwise.rl_config import TrainConfig
from rollwise.trainer.critic import Critic, estimate, gae, positions, token_rewards, whiten
from rollwise.trainer.grpo import GRPOConfig, GRPOTrainer
from rollwise.trainer.policy import Batch, PolicyModel

from tests.trainer.test_gigpo import episode


def brute(values, rewards, gamma, lam):
    """GAE from its definition: A_i = sum_l (gamma lam)^l delta_{i+l}."""
    v = values + [0.0]
    delta = [r + gamma * v[i + 1] - v[i] for i, r in enumerate(rewards)]
    return [sum((gamma * lam) ** k * d for k, d in enumerate(delta[i:])) for i in range(len(delta))]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.0), (0.97, 0.8)])
def test_gae_against_its_definition(gamma, lam):
    values, rewards = [0.3, -0.2, 0.5, 0.1, 0.7], [0.0, 0.5, 0.0, 0.0, 1.0]
    adv, ret = gae(values, rewards, gamma, lam)
    assert adv == pytest.approx(brute(values, rewards, gamma, lam))
    assert ret == pytest.approx([a + v for a, v in zip(adv, values)])
    if lam == 1.0 and gamma == 1.0:  # the return to go less the value
        assert adv == pytest.approx([sum(rewards[i:]) - v for i, v in enumerate(values)])


def test_rewards_sit_on_each_turns_last_token_across_contexts():
    first = episode([([10, 11], [50], 0.25)], tid="x")
    last = episode([([12], [60, 61], 0.0), ([13, 14, 15], [], 0.5)], prompt=[7, 8], tid="x")
    last.earlier = [first]
    last.reward = 2.0  # beyond its turns' 0.75: the episode's last token
    assert token_rewards(last) == [0.0, 0.25, 0.0, 0.0, 0.0, 1.75]
    # target j predicts token j + 1: `first`'s generated tokens 3-4 are targets 2-3
    assert positions(first) == [2, 3] and positions(last) == [1, 4, 5, 6]
    assert [j for j, m in enumerate(Batch.of([first, last]).mask[1].tolist()) if m] == positions(last)


def test_estimate_chains_an_episodes_contexts_and_skips_observations(model_dir):
    critic = Critic(PolicyModel(model_dir))
    torch.nn.init.normal_(critic.head.weight, std=0.5)  # values not all 0
    first = episode([([10, 11], [50], 0.0)], tid="x")
    last = episode([([12], [60, 61], 0.0), ([13, 14], [], 1.0)], prompt=[7, 8], tid="x")
    last.earlier = [first]
    other = episode([([20], [], 0.0)], tid="y")
    items = critic.estimate([last, other], 0.9, 0.7, micro_batch_tokens=8)  # a micro-batch per sequence
    assert len(items) == 3
    rows = {id(s): (b, a, g, v) for mb, b, a, g, v in items for s, *_ in [mb]}
    vals = [float(rows[id(s)][3][0, j]) for s in (first, last) for j in positions(s)]
    assert all(v != 0 for v in vals)
    want, ret = gae(vals, [0, 0, 0, 0, 1.0], 0.9, 0.7)  # one run over both contexts' generated tokens
    got = [float(rows[id(s)][1][0, j]) for s in (first, last) for j in positions(s)]
    assert got == pytest.approx(want) and [float(rows[id(s)][2][0, j]) for s in (first, last)
                                           for j in positions(s)] == pytest.approx(ret)
    for s in (first, last, other):  # nothing off the generated targets
        b, a, g, v = rows[id(s)]
        assert ((a != 0) <= (b.mask > 0)).all() and ((v != 0) <= (b.mask > 0)).all()


def test_the_critics_first_epoch_backpropagates_from_the_estimates_forward(model_dir):
    """`estimate(..., backward=)` takes the value loss's gradients from the forward that valued the
    tokens: the same gradients as valuing, then a second forward for the loss, with one forward per
    micro-batch, two for one whose episode goes on in a later micro-batch (its graph is dropped)."""
    critic = Critic(PolicyModel(model_dir))
    torch.nn.init.normal_(critic.head.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    first = episode([([10, 11], [50], 0.0)], tid="x")  # an episode of two contexts ...
    last = episode([([12], [60, 61], 0.0), ([13, 14], [], 1.0)], prompt=[7, 8, 9, 6, 5], tid="x")
    last.earlier = [first]
    others = [episode([([20 + i], [], float(i))], tid=f"y{i}") for i in range(2)]
    trajs = [last, *others]
    seen = []
    with torch.no_grad():  # a micro-batch per sequence
        items = estimate(trajs, 0.9, 0.7, 4, critic.values, done=lambda it: seen.append((id(it[1]), it[2].clone())))
    assert len(items) == 4 and sorted(i for i, _ in seen) == sorted(id(b) for _, b, *_ in items)
    assert all(torch.equal(a, dict((id(b), a) for _, b, a, _, _ in items)[i]) for i, a in seen)  # known when done
    where = {id(s): k for k, (mb, *_) in enumerate(items) for s in mb}
    assert where[id(first)] < where[id(last)]  # ... in different micro-batches, the first context's earlier
    calls = []
    forward = critic.values
    critic.values = lambda b: calls.append(b) or forward(b)

    def grads():
        out = torch.cat([p.grad.flatten() for p in critic.parameters()])
        critic.reset()
        return out

    for _, b, _, ret, old in critic.estimate(trajs, 0.9, 0.7, 4):
        critic._loss(b, ret, old, 1.0)[0].backward()
    two_passes, n_two = grads(), len(calls)
    calls.clear()
    critic.estimate(trajs, 0.9, 0.7, 4, backward=1.0)
    assert n_two == 8 and len(calls) == 5  # a forward per micro-batch, and the first context's again
    assert torch.allclose(grads(), two_passes, rtol=1e-6, atol=1e-9) and two_passes.abs().sum() > 0
    critic.estimate(trajs, 0.9, 0.7, 4, backward=1.0)
    with pytest.raises(ValueError, match="one divisor"):
        critic.estimate(trajs, 0.9, 0.7, 4, backward=5.0)


def test_the_critic_steps_once_per_mini_batch(model_dir):
    """mini_batches = 2: per epoch, a step on each part's mean value loss in turn (the second at the
    weights the first left), as verl's critic takes the actor's mini-batches."""
    trajs = [episode([([40 + i, 41], [50], 0.0), ([45 + i], [], float(i % 2))], tid=f"{i}") for i in range(4)]

    def critic():
        c = Critic(PolicyModel(model_dir))
        torch.nn.init.normal_(c.head.weight, std=0.5, generator=torch.Generator().manual_seed(0))
        c.opt = torch.optim.SGD(c.parameters(), lr=0.5)
        return c

    def weights(c):
        return torch.cat([p.detach().flatten() for p in c.parameters()])

    ref = critic()
    items = ref.estimate(trajs, 0.9, 0.7, micro_batch_tokens=14)  # two sequences a micro-batch: 2 of them
    assert len(items) == 2
    start = weights(ref)
    for part in ([items[0]], [items[1]]):  # by hand: one part's mean loss, a clipped step, then the next
        n = sum(float(b.mask.sum()) for _, b, *_ in part)
        for _, b, _, ret, old in part:
            ref._loss(b, ret, old, n)[0].backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), ref.max_grad_norm)
        ref.opt.step()
        ref.opt.zero_grad()
    got, whole = critic(), critic()
    m = got.update(got.estimate(trajs, 0.9, 0.7, 14), epochs=1, mini_batches=2)
    whole.update(whole.estimate(trajs, 0.9, 0.7, 14, backward=1.0), epochs=1)
    assert torch.allclose(weights(got), weights(ref), atol=1e-6) and m["value_loss"] > 0
    assert not torch.allclose(weights(whole), weights(ref), atol=1e-4)  # one step on the whole batch differs
    assert (weights(ref) - start).abs().max() > 1e-3
    again = critic()
    again.estimate(trajs, 0.9, 0.7, 14, backward=1.0)
    with pytest.raises(ValueError, match="one part"):
        again.update(items, epochs=1, mini_batches=2)
    policy = PolicyModel(model_dir)  # the trainer passes its mini_batches (and backpropagates no first epoch early)
    trainer = GRPOTrainer(policy, GRPOConfig(advantage="gae", mini_batches=2, micro_batch_tokens=14))
    m = trainer.step([fresh(policy, trajs)])
    assert m["trained_trajectories"] == 4 and m["value_loss"] > 0


def fresh(policy, trajs):
    for t in trajs:  # behaviour logprobs: the policy's own (fresh samples, ratio 1)
        b = Batch.of([t])
        t.logprobs = [0.0] + (policy.logprobs(b).detach() * b.mask)[0].tolist()
    return trajs


def test_gae_steps_fit_the_critic_and_move_the_policy_toward_reward(model_dir):
    policy = PolicyModel(model_dir)
    won = episode([([40, 41], [50, 51], 0.0), ([42], [], 1.0)], tid="w")
    lost = episode([([60, 61], [50, 51], 0.0), ([62], [], 0.0)], tid="l")
    groups = [fresh(policy, [won]), fresh(policy, [lost])]  # groups of one: no group baseline at all
    before = policy.logprobs(Batch.of([won, lost])).detach()
    trainer = GRPOTrainer(policy, GRPOConfig(lr=3e-3, advantage="gae", critic_lr=3e-3))
    ms = []
    for _ in range(6):
        ms.append(trainer.step(groups))
        fresh(policy, [won, lost])
    assert ms[0]["trained_trajectories"] == 2 and ms[0]["logprob_diff"] < 1e-3
    assert ms[0]["value_mean"] == 0.0 and ms[0]["explained_var"] == 0.0  # a zero head: the values start at 0
    assert ms[-1]["value_loss"] < 0.5 * ms[0]["value_loss"] and ms[-1]["explained_var"] > 0.5
    assert ms[0]["return_mean"] == pytest.approx(0.5)  # returns to go: won's 3 tokens 1, lost's 3 tokens 0
    gain = policy.logprobs(Batch.of([won, lost])).detach() - before
    assert gain[0].sum() > 0 and gain[1].sum() < 0


def test_a_lora_critic_trains_adapters_on_the_policys_own_frozen_weights(model_dir):
    """critic_lora: the critic's base tensors are the LoRA policy's (shared storage, never trained);
    its adapters and head train, and the checkpoint keeps them alone."""
    policy = PolicyModel(model_dir)
    policy.add_lora(4, 8.0)
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-2, advantage="gae", critic_lr=1e-2, critic_lora=True))
    critic = trainer.critic
    base = {v.data_ptr() for v in policy.base_state().values()}
    frozen = [(n, p) for n, p in critic.body.named_parameters() if not p.requires_grad]
    assert frozen and all(p.data_ptr() in base for _, p in frozen)  # the policy's tensors, not copies
    assert all("lora_" in n for n, p in critic.body.named_parameters() if p.requires_grad)
    before = {n: p.detach().clone() for n, p in critic.body.named_parameters()}
    won = episode([([40, 41], [50, 51], 0.0), ([42], [], 1.0)], tid="w")
    lost = episode([([60, 61], [50, 51], 0.0), ([62], [], 0.0)], tid="l")
    ms = [trainer.step([fresh(policy, [won]), fresh(policy, [lost])]) for _ in range(4)]
    assert ms[-1]["value_loss"] < ms[0]["value_loss"]
    moved = {n for n, p in critic.body.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)  # the adapters trained, the shared base did not
    state = trainer.state()["critic"]
    assert state["body"] and all("lora_" in k for k in state["body"])
    policy2 = PolicyModel(model_dir)
    policy2.add_lora(4, 8.0)
    again = GRPOTrainer(policy2, GRPOConfig(advantage="gae", critic_lora=True))
    again.critic.load_state(state)
    assert all(torch.equal(a, b) for a, b in zip(again.critic.parameters(), critic.parameters()))
    with pytest.raises(ValueError, match="needs the policy to train LoRA"):
        GRPOTrainer(PolicyModel(model_dir), GRPOConfig(advantage="gae", critic_lora=True))
    with pytest.raises(ValueError, match="lora_rank > 0"):
        TrainConfig.from_dict({"model": "m", "advantage": "gae", "critic_lora": True})


def result(m, policy, trainer):
    critic = trainer.critic.parameters() if trainer.critic is not None else [torch.zeros(1)]
    return (m, torch.cat([p.detach().flatten() for p in policy.parameters()]),
            torch.cat([p.detach().flatten() for p in critic]))


@pytest.mark.parametrize("advantage,extra", [
    ("gae", {}), ("gae", {"epochs": 2, "micro_batch_tokens": 24}),
    ("reinforce_plus_plus", {"policy_loss": "cispo", "kl_coef": 0.1, "entropy_coef": 0.01}),
    ("reinforce_plus_plus", {"policy_loss": "sapo", "sapo_tau_neg": 3.0}),
    ("reinforce_plus_plus_baseline", {"policy_loss": "gspo", "loss_agg": "sequence", "clip": 3e-4}),
    ("reinforce_plus_plus_baseline", {"mini_batches": 2, "micro_batch_tokens": 24, "loss_agg": "constant",
                                      "loss_scale_tokens": 8})])
def test_a_streamed_whitened_step_equals_the_whole_batch_step(model_dir, advantage, extra):
    """Streamed, each group's first pass runs as it arrives, on advantages not yet whitened (the loss at
    A and at 1 apart, combined at the end): the same step as with the pass after the last group, and
    as the whole batch's (`step`; the critic's first epoch streams in both streamed modes)."""
    groups = [[episode([([40 + i, 41], [50], 0.0), ([45 + j], [], float(i == j))], tid=f"{j}{i}") for i in range(2)]
              for j in range(3)]
    out = []
    for mode in ("after", "early", "step"):  # streamed, the pass after the batch / as groups arrive; whole
        if mode == "step" and "mini_batches" in extra:  # (its parts are the micro-batches in arrival order)
            continue
        early = mode == "early"
        policy = PolicyModel(model_dir)
        fresh(policy, [t for g in groups for t in g])
        trainer = GRPOTrainer(policy, GRPOConfig(lr=0.5, advantage=advantage, critic_lr=0.5, gae_gamma=0.9,
                                                 stream_whitened=early, **extra))
        # SGD: an update linear in the gradients (AdamW's first step, lr x sign, would blow up their rounding)
        trainer.opt = torch.optim.SGD(policy.parameters(), lr=0.5)
        if trainer.critic is not None:
            torch.nn.init.normal_(trainer.critic.head.weight, std=0.5, generator=torch.Generator().manual_seed(0))
            trainer.critic.opt = torch.optim.SGD(trainer.critic.parameters(), lr=0.5)
        if mode == "step":
            out.append(result(trainer.step(groups), policy, trainer))
            continue
        trainer.begin()
        trainer.add(groups[:1])
        assert bool(trainer._acc["items"]) == early  # the first group's pass ran as it arrived, or waits
        trainer.add(groups[1:2])
        waiting = len(trainer._acc["later"])
        assert (waiting == 0) == early
        trainer.add(groups[2:], final=True)  # the last groups' pass waits for the whitening either way
        assert len(trainer._acc["later"]) > waiting
        out.append(result(trainer.finish(), policy, trainer))
    (m0, p0, c0), *rest = out
    assert m0["trained_trajectories"] == 6
    for m1, p1, c1 in rest:  # up to float rounding
        assert torch.allclose(p0, p1, atol=1e-5) and torch.allclose(c0, c1, atol=1e-5)
        assert m0.keys() == m1.keys()
        for k in m0:
            assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6, nan_ok=True), k
    start = torch.cat([p.detach().flatten() for p in PolicyModel(model_dir).parameters()])
    assert (p0 - start).abs().max() > 1e-2  # the step moved the weights far more than the tolerance


def test_critic_warmup_keeps_the_policy_and_the_checkpoint_keeps_the_critic(model_dir):
    policy = PolicyModel(model_dir)
    groups = [fresh(policy, [episode([([40], [], 1.0)], tid="a"), episode([([41], [], 0.0)], tid="b")])]
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-2, advantage="gae", critic_lr=1e-2, critic_warmup=1))
    start = [p.detach().clone() for p in policy.parameters()]
    m = trainer.step(groups)
    assert m["critic_warmup"] == 1.0 and trainer.version == 1
    assert all(torch.equal(a, p) for a, p in zip(start, policy.parameters()))  # the policy waited
    assert trainer.critic.head.weight.abs().sum() > 0  # the critic trained
    assert trainer.step(groups)["critic_warmup"] == 0.0
    assert not all(torch.equal(a, p) for a, p in zip(start, policy.parameters()))
    again = GRPOTrainer(PolicyModel(model_dir), GRPOConfig(advantage="gae"))
    again.load_state(trainer.state())
    assert all(torch.equal(a, b) for a, b in zip(again.critic.parameters(), trainer.critic.parameters()))
    state = GRPOTrainer(PolicyModel(model_dir), GRPOConfig()).state()  # a grpo run's checkpoint
    with pytest.raises(ValueError, match="critic"):
        again.load_state(state)


def test_reinforce_plus_plus_advantages_before_and_after_whitening():
    a = episode([([10, 11], [50], 0.0), ([12], [], 1.0)], tid="a")
    b = episode([([13], [], 0.0)], tid="b")
    items = estimate([a, b], 0.9, 1.0, micro_batch_tokens=64)  # no values: the discounted returns to go
    (mb, batch, adv, ret, v), = items
    rows = {id(s): i for i, s in enumerate(mb)}
    assert adv[rows[id(a)], positions(a)].tolist() == pytest.approx([0.81, 0.9, 1.0])
    assert adv[rows[id(b)], positions(b)].tolist() == [0.0] and not v.any()
    mean, std = whiten(items)
    flat = torch.tensor([0.81, 0.9, 1.0, 0.0])
    assert (mean, std) == pytest.approx((float(flat.mean()), float(flat.std())), rel=1e-6)
    # _baseline: the episode's advantage (reward less its group's mean) on each of its tokens
    (_, _, adv, _, _), = estimate([a, b], 0.9, 1.0, 64, episode={id(a): 0.5, id(b): -0.5})
    assert adv[rows[id(a)], positions(a)].tolist() == [0.5] * 3 and adv[rows[id(b)], positions(b)].tolist() == [-0.5]


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_steps_train_every_kept_episode(model_dir, estimator):
    policy = PolicyModel(model_dir)
    won, lost = episode([([40, 41], [], 1.0)], tid="w"), episode([([60, 61], [], 0.0)], tid="l")
    same = [episode([([70], [], 1.0)], tid=f"s{i}") for i in range(2)]  # a group with no spread
    fresh(policy, [won, lost, *same])
    before = policy.logprobs(Batch.of([won, lost])).detach()
    m = GRPOTrainer(policy, GRPOConfig(lr=1e-2, advantage=estimator)).step([[won, lost], same])
    # every kept episode carries loss: whitening subtracts the batch's mean, which can move a 0 off 0
    assert m["trained_trajectories"] == 4 and "value_loss" not in m and m["logprob_diff"] < 1e-3
    gain = policy.logprobs(Batch.of([won, lost])).detach() - before
    assert gain[0].sum() > 0 and gain[1].sum() < 0


def test_a_fresh_critic_makes_gae_reinforce_plus_plus(model_dir):
    """The value head starts at 0, so the first gae step's advantages are the returns to go: the same
    update as REINFORCE++'s, bit for bit (and the critic is what sets them apart afterwards)."""
    updated = []
    for estimator in ("gae", "reinforce_plus_plus"):
        policy = PolicyModel(model_dir)
        groups = [fresh(policy, [episode([([40 + i, 41], [50], 0.0), ([42], [], float(i))], tid=str(i))])
                  for i in range(3)]
        GRPOTrainer(policy, GRPOConfig(lr=1e-2, advantage=estimator, gae_gamma=0.9)).step(groups)
        updated.append(torch.cat([p.detach().flatten() for p in policy.parameters()]))
    assert torch.equal(updated[0], updated[1])


def test_a_critic_of_another_model_reads_the_policys_tokens(model_dirs, tmp_path):
    from rollwise.make_model import make_model
    policy = PolicyModel(model_dirs["qwen3"])
    won, lost = fresh(policy, [episode([([40, 41], [50], 0.0), ([42], [], 1.0)], tid="w"),
                               episode([([60], [50], 0.0), ([62], [], 0.0)], tid="l")])
    trainer = GRPOTrainer(policy, GRPOConfig(advantage="gae", critic_lr=1e-2, critic_model=model_dirs["qwen3_moe"]))
    assert len(trainer.critic.body.layers) == 2 and hasattr(trainer.critic.body.layers[0].mlp, "experts")
    ms = [trainer.step([[won, lost]]) for _ in range(3)]
    assert ms[-1]["value_loss"] < ms[0]["value_loss"]
    other = make_model(tmp_path / "other", family="llama", layers=1, hidden=32, heads=2, kv_heads=1, vocab=512)
    with pytest.raises(ValueError, match="vocabulary of 512"):
        GRPOTrainer(policy, GRPOConfig(advantage="gae", critic_model=str(other)))


def test_gae_config_is_checked():
    cfg = TrainConfig.from_dict({"model": "m", "advantage": "gae", "group_size": 1, "gae_lambda": 0.95})
    assert cfg.group_size == 1 and cfg.gae_lambda == 0.95
    with pytest.raises(ValueError, match="group_size >= 2"):
        TrainConfig.from_dict({"model": "m", "group_size": 1})
    with pytest.raises(ValueError, match="gae_lambda"):
        TrainConfig.from_dict({"model": "m", "advantage": "gae", "gae_lambda": 1.5})
    with pytest.raises(ValueError, match="value_clip"):
        TrainConfig.from_dict({"model": "m", "advantage": "gae", "value_clip": 0})
    with pytest.raises(ValueError, match="dynamic_sampling"):
        TrainConfig.from_dict({"model": "m", "advantage": "gae", "dynamic_sampling": True, "deterministic": False})
    with pytest.raises(ValueError, match="valid.*gae.*reinforce_plus_plus_baseline"):
        TrainConfig.from_dict({"model": "m", "advantage": "gea"})
    assert TrainConfig.from_dict({"model": "m", "advantage": "reinforce_plus_plus", "group_size": 1}).group_size == 1
    with pytest.raises(ValueError, match="group_size >= 2"):  # its baseline is the group's mean
        TrainConfig.from_dict({"model": "m", "advantage": "reinforce_plus_plus_baseline", "group_size": 1})


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_the_critic_starts_as_a_copy_of_the_warm_start_built_without_a_second_model(model_dirs, family):
    """Built on the meta device and given copies of the policy's tensors (the rotary buffers too): the
    same hidden states as the policy's decoder, in tensors of its own."""
    policy = PolicyModel(model_dirs[family])
    critic = Critic(policy)
    ids = torch.tensor([[5, 17, 300, 42, 7, 99]])
    with torch.no_grad():
        assert torch.equal(critic.body(input_ids=ids).last_hidden_state,
                           policy.model.get_decoder()(input_ids=ids).last_hidden_state)
    own = {p.data_ptr() for p in policy.model.parameters()}
    assert not any(p.data_ptr() in own for p in critic.body.parameters())
