"""Qwen3-MoE: the engine's sparse experts against transformers', weights from a trainer, which layers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rollwise import LLM, SamplingParams
from rollwise.engine.models.llama import ModelConfig
from rollwise.make_model import hf_config


def _cfg(**kw) -> dict:
    cfg = hf_config("qwen3_moe", vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, head_dim=8,
                    max_positions=128, tie=False, eos_id=1, bos_id=0, experts=6, experts_per_token=2)
    return cfg | kw


def test_which_layers_have_experts():
    assert ModelConfig.from_hf(_cfg()).moe_layers == (0, 1, 2, 3)
    assert ModelConfig.from_hf(_cfg(mlp_only_layers=[0, 2])).moe_layers == (1, 3)
    assert ModelConfig.from_hf(_cfg(decoder_sparse_step=2)).moe_layers == (1, 3)
    legacy = _cfg()
    legacy["num_local_experts"] = legacy.pop("num_experts")  # as transformers 5 writes config.json
    c = ModelConfig.from_hf(legacy)
    assert (c.num_experts, c.experts_per_token, c.qk_norm) == (6, 2, True)
    with pytest.raises(ValueError, match="experts_per_token"):
        hf_config("qwen3_moe", vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, head_dim=8,
                  max_positions=128, tie=False, eos_id=1, bos_id=0, experts=2, experts_per_token=3)


def test_checkpoint_lists_each_expert_and_a_layer_without_experts_is_dense(tmp_path):
    from rollwise.engine.models.llama import CausalLM
    from rollwise.engine.models.moe import SparseMoE
    model = CausalLM(ModelConfig.from_hf(_cfg(mlp_only_layers=[1])), max_positions=8)
    names = model.hf_tensors()
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names and not any("layers.1.mlp.experts" in n for n in names)
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == [True, False, True, True]
    # a view writes its expert's slice of the fused parameter
    names["model.layers.0.mlp.experts.3.up_proj.weight"].data.fill_(7.0)
    up = model.model.layers[0].mlp.experts.gate_up_proj[3, 16:]
    assert bool((up == 7.0).all()) and not bool((model.model.layers[0].mlp.experts.gate_up_proj[3, :16] == 7).any())


def test_trainer_weights_in_transformers_layout_update_the_engine(model_dirs):
    """A trainer holds experts fused ([E, 2I, H]); the engine takes them as they are, and its samples'
    logprobs are the trainer's under the new weights."""
    from rollwise.trainer.policy import Batch, PolicyModel
    d = model_dirs["qwen3_moe"]
    policy = PolicyModel(d)
    w = policy.engine_weights()
    assert any(k.endswith("mlp.experts.gate_up_proj") and v.dim() == 3 for k, v in w.items())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=g))
    llm = LLM(d, seed=1, kv_cache_gb=0.05)
    llm.engine.update_weights(policy.engine_weights(), 1)
    prompts = [[5 + i, 17, 300 + i, 42] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1))
    from rollwise.types import Trajectory
    trajs = [Trajectory(trajectory_id=str(i), group_id="g", task={}, token_ids=p + o.token_ids,
                        loss_mask=[0] * len(p) + [1] * len(o.token_ids), logprobs=[0.0] * len(p) + o.logprobs)
             for i, (p, o) in enumerate(zip(prompts, outs))]
    b = Batch.of(trajs)
    lp = policy.logprobs(b).detach()
    assert (lp - b.behaviour_logprobs).mul(b.mask).abs().max() < 1e-3
    # and a wrongly shaped expert tensor is refused whole
    bad = {k: v[:, :-1] for k, v in w.items() if k.endswith("experts.gate_up_proj")}
    with pytest.raises(ValueError, match="shape"):
        llm.engine.update_weights(bad, 2)


def test_speculation_is_lossless_on_experts(model_dirs):
    """Drafted tokens are routed one by one like any other row: greedy outputs and logprobs equal
    decoding without speculation."""
    d = model_dirs["qwen3_moe"]
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(d, kv_cache_gb=0.05).generate(prompts, sp)
    llm = LLM(d, speculative="suffix", spec_controller="always", spec_tree=True, kv_cache_gb=0.05)
    for _ in range(2):  # the second round drafts from the first's outputs too
        for a, b in zip(plain, llm.generate(prompts, sp)):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert llm.metrics()["spec_accepted_tokens"] > 0


def _hf_routing(d: str, ids: list[int]):
    """transformers' own choice of experts for each position of `ids`: [len, layers, k]."""
    import numpy as np
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    got = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: got.append(o[2])) for layer in hf.model.layers]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return np.stack([g.numpy() for g in got], axis=1)


@pytest.mark.parametrize("spec", [False, True])
def test_routed_experts_are_the_routing_of_every_token(model_dirs, spec):
    """Each token's experts as transformers routes them, prompt tokens taken from the prefix cache
    included (their routing is kept beside their KV), with or without tree drafts."""
    d = model_dirs["qwen3_moe"]
    kw = dict(speculative="suffix", spec_controller="always", spec_tree=True) if spec else {}
    llm = LLM(d, enable_return_routed_experts=True, **kw, kv_cache_gb=0.05)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, return_routed_experts=True)
    shared = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10, 11, 12]  # > one 16-token block
    first = llm.generate([shared + [13]], sp)[0]
    again = llm.generate([shared + [14, 15]], sp)[0]
    assert again.num_cached_tokens >= 16
    for out in (first, again):
        ids = out.prompt_token_ids + out.token_ids
        r = out.routed_experts
        assert r.shape == (len(ids) - 1, 2, 2) and r.dtype.name == "int32"
        assert (r == _hf_routing(d, ids[:-1])).all()
    if spec:
        assert llm.metrics()["spec_accepted_tokens"] > 0
    assert (first.outputs[0].routed_experts == first.routed_experts).all()  # (vLLM's CompletionOutput has them)
    # vLLM's routed_experts_prompt_start: a later turn leaves out what an earlier one returned
    later = llm.generate([shared + [14, 15]], dataclasses.replace(sp, routed_experts_prompt_start=16))[0]
    assert later.token_ids == again.token_ids and (later.routed_experts == again.routed_experts[16:]).all()
    with pytest.raises(ValueError, match="routed_experts_prompt_start must be <="):
        llm.generate([[5, 6]], dataclasses.replace(sp, routed_experts_prompt_start=3))
    plain = llm.generate([shared], SamplingParams(max_tokens=4))[0]
    assert plain.routed_experts is None  # only for requests that ask


def test_routed_experts_need_the_engine_flag_and_a_model_with_experts(model_dirs):
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        LLM(model_dirs["qwen3_moe"], kv_cache_gb=0.05).generate([[5, 6]], SamplingParams(max_tokens=2, return_routed_experts=True))
    with pytest.raises(ValueError, match="needs a model with experts"):
        LLM(model_dirs["qwen3"], enable_return_routed_experts=True, kv_cache_gb=0.05)


def test_routed_experts_over_http_through_the_router_into_an_episode(model_dirs):
    """`rollwise serve --enable-return-routed-experts`: SGLang's request flag gets meta_info.routed_experts;
    an episode through the router on that replica keeps its context's routing, as transformers routes it."""
    import asyncio
    import httpx
    from rollwise.agent.envs import make_env
    from rollwise.agent.episode import collect
    from rollwise.engine.tokenizer import Tokenizer
    from rollwise.router.replica import HttpReplica
    from rollwise.router.router import Router
    from rollwise.serve.process import ServerProcess
    from rollwise.wire import decode_routing
    d = model_dirs["qwen3_moe"]
    with ServerProcess(d, "--enable-return-routed-experts", "--max-model-len", "1024", threads=1) as s:
        r = httpx.post(f"{s.url}/generate", json={"input_ids": [5, 6, 7, 8], "return_routed_experts": True,
                                                   "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
        got = decode_routing(r["meta_info"]["routed_experts"], (-1, 2, 2))
        assert r["routed_experts_shape"] == [9, 2, 2] and (got == _hf_routing(d, [5, 6, 7, 8] + r["token_ids"][:-1])).all()
        bad = httpx.post(f"{s.url}/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2,
                                                                                         "return_routed_experts": 1}})
        assert bad.status_code == 400

        async def episodes():
            router = Router([HttpReplica(s.url)], "verl", tokenizer=Tokenizer(d))
            tasks = make_env("calculator").sample_tasks(2, seed=0)
            try:
                return [t async for g in collect(router, lambda: make_env("calculator"), tasks,
                                                 SamplingParams(max_tokens=24, return_routed_experts=True), group_size=1)
                        for t in g]
            finally:
                await router.close()
        for t in asyncio.run(episodes()):
            routing = t.routing()
            n = routing.shape[0]
            assert routing.shape[1:] == (2, 2) and n >= len(t.token_ids) - 1 - t.turns[-1].num_observation - 1
            assert (routing == _hf_routing(d, t.token_ids[:n])).all()
