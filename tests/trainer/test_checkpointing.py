"""Gradient checkpointing: the same logprobs and gradients as without, for fewer activations kept,
with the batch's shared prefix run once or not, for every family, LoRA and the critic."""
from __future__ import annotations

import random

import pytest
import torch

from rollwise.rl_config import TrainConfig
from rollwise.trainer.grpo import GRPOConfig, GRPOTrainer
from rollwise.trainer.policy import Batch, PolicyModel
from rollwise.types import Trajectory, TurnRecord


def _trajs(n: int = 4, shared: int = 40, seed: int = 0) -> list[Trajectory]:
    """A group: a common prompt of `shared` tokens, then each row's generated tokens."""
    rng = random.Random(seed)
    head = [rng.randrange(10, 1000) for _ in range(shared)]
    out = []
    for i in range(n):
        gen = [rng.randrange(10, 1000) for _ in range(12 + 5 * i)]
        turn = TurnRecord(start=shared, num_generated=len(gen), num_observation=0, finish_reason="length",
                          policy_version=0, num_cached_tokens=0, generation_s=0, tool_s=0)
        out.append(Trajectory(trajectory_id=f"t{i}", group_id="g", task={}, token_ids=head + gen,
                              loss_mask=[0] * shared + [1] * len(gen), logprobs=[-3.0] * (shared + len(gen)),
                              turns=[turn], reward=float(i % 2)))
    return out


def _pass(policy: PolicyModel, b: Batch, min_shared: int):
    """Logprobs, gradients and the bytes autograd kept for the backward."""
    policy.model.zero_grad()
    kept = [0]

    def pack(t):
        kept[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = policy.logprobs(b, min_shared=min_shared)
    (-(lp * b.mask).sum()).backward()
    return lp.detach() * b.mask, [p.grad.clone() for p in policy.parameters()], kept[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("min_shared", [10**9, 32])
def test_checkpointing_gives_the_same_gradients_and_keeps_fewer_activations(model_dirs, family, min_shared):
    b = Batch.of(_trajs())
    assert b.shared == 40
    plain = _pass(PolicyModel(model_dirs[family]), b, min_shared)
    policy = PolicyModel(model_dirs[family])
    policy.enable_checkpointing()
    ckpt = _pass(policy, b, min_shared)
    assert torch.equal(ckpt[0], plain[0])
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(ckpt[1], plain[1]))
    assert ckpt[2] < 0.6 * plain[2]  # the layers' inputs kept, not their activations


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_the_output_head_in_chunks_gives_the_same_logprobs_entropies_and_gradients(model_dirs, family):
    """`head_chunk`: the generated positions through the output head a few at a time, each chunk's
    logits recomputed in the backward; the same values as all at once (up to the GEMM's rounding),
    and only the chunks' inputs kept for the backward, not their logits."""
    b = Batch.of(_trajs())

    def run(chunk: int):
        policy = PolicyModel(model_dirs[family])
        policy.head_chunk = chunk
        kept = [0]

        def pack(t):
            kept[0] += t.numel() * t.element_size()
            return t
        ent: list = []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp = policy.logprobs(b, temperature=0.7, entropy=ent)
        (-(lp * b.mask).sum() - ent[0].sum()).backward()
        with torch.no_grad():
            ref = policy.logprobs(b, temperature=0.7)  # (no graph: the chunks one after another)
        return lp.detach(), ent[0].detach(), [p.grad for p in policy.parameters()], kept[0], ref
    whole, chunked = run(0), run(7)  # 7: the 78 generated positions in 12 chunks, the last one short
    assert torch.allclose(chunked[0], whole[0], atol=1e-6) and torch.allclose(chunked[1], whole[1], atol=1e-5)
    assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(chunked[2], whole[2]))  # (sums reordered)
    assert torch.allclose(chunked[4], whole[4], atol=1e-6) and torch.allclose(chunked[4], chunked[0], atol=1e-6)
    assert chunked[3] < whole[3]  # no [positions, vocabulary] logits kept
    assert (b.mask.sum(), whole[0].ne(0).sum()) == (78, 78)
    with pytest.raises(ValueError, match="logit_chunk_tokens must be >= 0"):
        TrainConfig.from_dict({"model": model_dirs[family], "logit_chunk_tokens": -1})


def test_checkpointing_trains_lora_adapters_alike(model_dir):
    b = Batch.of(_trajs(seed=1))
    out = []
    for ckpt in (False, True):
        policy = PolicyModel(model_dir)
        policy.add_lora(4, 8)
        with torch.no_grad():  # B = 0 at first: some gradient reaches A too
            for p in policy.parameters():
                p.normal_(std=0.02)
        if ckpt:
            policy.enable_checkpointing()
        out.append(_pass(policy, b, 32))
    assert torch.equal(out[0][0], out[1][0]) and len(out[0][1]) > 0
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(out[0][1], out[1][1]))


def test_a_gae_step_with_checkpointing_moves_policy_and_critic_alike(model_dir):
    after = []
    for ckpt in (False, True):
        policy = PolicyModel(model_dir)
        if ckpt:
            policy.enable_checkpointing()
        cfg = GRPOConfig(lr=1e-2, advantage="gae", critic_lr=1e-2, logprob_tolerance=float("inf"))  # (made-up
        trainer = GRPOTrainer(policy, cfg)  # rollout logprobs: not the check's business here)
        assert any(getattr(m, "gradient_checkpointing", False) for m in trainer.critic.body.modules()) == ckpt
        trainer.step([_trajs(seed=2)])
        after.append([p.detach().clone() for p in [*policy.parameters(), *trainer.critic.parameters()]])
    assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(*after))
    assert not torch.equal(after[0][-1], torch.zeros_like(after[0][-1]))  # the value head moved


def test_the_run_config_sets_the_micro_batches_and_refuses_routing_replay_with_checkpointing(model_dirs):
    assert TrainConfig(model="m", micro_batch_tokens=512).trainer_config().micro_batch_tokens == 512
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        GRPOConfig(micro_batch_tokens=0).check()
    with pytest.raises(ValueError, match="routing_replay = 'replay' does not work with gradient_checkpointing"):
        TrainConfig.from_dict({"model": "m", "routing_replay": "replay", "gradient_checkpointing": True})
    policy = PolicyModel(model_dirs["qwen3_moe"])  # (as a library: the layers replayed would route otherwise)
    policy.routing = "replay"
    policy.enable_checkpointing()
    b = Batch.of(_trajs())
    b.routing = torch.zeros(*b.input_ids.shape, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="routing replay does not work with gradient checkpointing"):
        policy.logprobs(b)
