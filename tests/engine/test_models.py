"""The engine's own forward against transformers' reference implementation."""
from __future__ import annotations

import pytest
import torch

from rollwise import LLM, SamplingParams
from rollwise.engine.models.loader import load_model, save_model, read_hf_config

transformers = pytest.importorskip("transformers")

PROMPTS = ["The agent reads the task", "SELECT name FROM products", "What is 12 * 7?", "a"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_greedy_and_logits_match_transformers(model_dirs, family):
    d = model_dirs[family]
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(d, max_num_seqs=8)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(ids):].tolist()
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out.token_ids])).logits[0].float()
        ref_lp = torch.log_softmax(logits, -1)[len(ids) - 1:-1].gather(1, torch.tensor(out.token_ids)[:, None])
        assert torch.allclose(torch.tensor(out.logprobs), ref_lp.squeeze(1), atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_full_logits_match_transformers(model_dirs, family):
    """Logits of every position of a prefill, through the paged-attention path."""
    from rollwise.engine.attention import build_metadata
    d = model_dirs[family]
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = load_model(d)
    ids = list(range(5, 45))
    cfg = model.config
    kv = (torch.zeros(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim),) * 1
    kv = (kv[0], torch.zeros_like(kv[0]))
    # two chunks: 25 tokens, then 15 more reading the first chunk's KV from the cache
    table = [3, 0, 2]
    with torch.no_grad():
        h1 = model(torch.tensor(ids[:25]), torch.arange(25), build_metadata([25], [0], [table], 16, "cpu"), kv)
        h2 = model(torch.tensor(ids[25:]), torch.arange(25, 40), build_metadata([15], [25], [table], 16, "cpu"), kv)
        ours = model.logits(torch.cat([h1, h2]))
        ref = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_bf16_runs_and_agrees_roughly(model_dirs):
    d = model_dirs["llama"]
    a = LLM(d).generate(["The agent"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    b = LLM(d, dtype="bfloat16").generate(["The agent"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(b.token_ids) == 4 and all(lp <= 0 for lp in b.logprobs)
    assert a.token_ids[0] == b.token_ids[0]


def test_save_and_reload_roundtrip(model_dirs, tmp_path):
    d = model_dirs["qwen3"]
    model = load_model(d)
    save_model(model, read_hf_config(d), tmp_path)
    again = load_model(tmp_path)
    for (n, p), (_, q) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(p, q), n
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()  # still tied


def test_loading_a_model_does_no_meta_math(model_dirs):
    # torch runs an op on the meta device through its Python reference, whose first call imports sympy
    # and torch._dynamo (1.8 s of every engine's start): the loader builds on meta and computes there
    # nothing but empty tensors, so an engine's process never imports them
    import subprocess
    import sys
    code = ("import sys; from rollwise.engine.models.loader import load_model; "
            f"m = load_model({str(model_dirs['qwen3'])!r}, dtype='bfloat16'); "
            "print(m.lm_head.weight.dtype, 'sympy' in sys.modules, 'torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["torch.bfloat16", "False", "False"]


def test_unsupported_family_is_a_clear_error(tmp_path):
    from rollwise.engine.models.llama import ModelConfig
    with pytest.raises(ValueError, match="supported"):
        ModelConfig.from_hf({"model_type": "gpt2", "num_attention_heads": 2})
