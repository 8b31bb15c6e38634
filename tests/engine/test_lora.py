"""Multi-LoRA serving: peft adapters beside the base weights, mixed in one batch, against the
merged model transformers / peft would give."""
from __future__ import annotations

import pytest
import torch

from rollwise import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32], [40, 41, 42, 43], [50]]


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory):
    """Two peft adapters (rank 8 on every linear; rank 4 on q and v, rsLoRA) trained to nothing in
    particular (random B), and each merged into the weights as a model of its own."""
    from rollwise.trainer.policy import PolicyModel
    d, root = model_dirs["qwen3"], tmp_path_factory.mktemp("lora")
    out = {}
    for name, (rank, alpha, targets, rs) in {"all": (8, 16, "all-linear", False), "qv": (4, 8, ["q_proj", "v_proj"], True)}.items():
        policy = PolicyModel(d)
        policy.add_lora(rank, alpha, targets)
        if rs:
            policy.lora.use_rslora = True
            for _, m in policy._lora_layers():
                m.scaling["default"] = alpha / rank ** 0.5
        g = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for n, p in policy.model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
        policy.save_adapter(str(root / name), d)
        policy.save(str(root / f"{name}-merged"))
        out[name] = (str(root / name), str(root / f"{name}-merged"))
    return out


@pytest.mark.parametrize("spec", [False, True])
def test_a_batch_mixes_adapters_and_the_base(model_dirs, adapters, spec):
    d = model_dirs["qwen3"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(speculative="suffix", spec_controller="always") if spec else {}
    llm = LLM(d, enable_lora=True, **kw, kv_cache_gb=0.05)
    for name, (path, _) in adapters.items():
        llm.engine.add_lora(name, path)
    names = ["all", None, "qv", "all"]
    refs = {None: LLM(d, kv_cache_gb=0.05).generate(PROMPTS, greedy)}
    for name, (_, merged) in adapters.items():
        refs[name] = LLM(merged, kv_cache_gb=0.05).generate(PROMPTS, greedy)
    assert refs["all"][0].token_ids != refs[None][0].token_ids  # the adapters change the model
    for _ in range(2):  # the second round hits the prefix cache (and drafts from the first, with spec)
        outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, lora=n) for n in names])
        for i, (o, n) in enumerate(zip(outs, names)):
            assert o.token_ids == refs[n][i].token_ids, (i, n)
            assert o.logprobs == pytest.approx(refs[n][i].logprobs, abs=1e-3)


def test_vllms_lora_request_loads_and_picks_the_adapter(model_dirs, adapters):
    """LLM.generate(..., lora_request=LoRARequest(name, id, path)) as in vLLM: one for all or one per
    prompt, loaded from its path the first time; the same tokens as the merged model's."""
    from rollwise import LoRARequest
    d = model_dirs["qwen3"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = {n: LLM(m, kv_cache_gb=0.05).generate(PROMPTS[:2], greedy) for n, (_, m) in adapters.items()}
    base = LLM(d, kv_cache_gb=0.05).generate(PROMPTS[:2], greedy)
    llm = LLM(d, enable_lora=True, kv_cache_gb=0.05)
    qv = LoRARequest("qv", 2, adapters["qv"][0])
    outs = llm.generate(PROMPTS[:2], greedy, lora_request=[qv, None])
    assert [o.token_ids for o in outs] == [want["qv"][0].token_ids, base[1].token_ids]
    assert sorted(llm.engine.loras) == ["qv"]
    again = llm.chat([{"role": "user", "content": "hi"}], greedy, lora_request=LoRARequest("qv"))  # loaded: no path
    assert again[0].token_ids == LLM(adapters["qv"][1], kv_cache_gb=0.05).chat(
        [{"role": "user", "content": "hi"}], greedy)[0].token_ids
    outs = llm.generate(PROMPTS[:2], greedy, lora_request=LoRARequest("all", 1, adapters["all"][0]))
    assert [o.token_ids for o in outs] == [o.token_ids for o in want["all"]]
    for bad, match in ((LoRARequest("nope"), "no lora_path"), ("qv", "must be a LoRARequest"), ([qv], "lora_requests")):
        with pytest.raises(ValueError, match=match):
            llm.generate(PROMPTS[:2], greedy, lora_request=bad)
    assert not llm.engine.has_unfinished


def test_a_vllm_offline_script_runs_as_written(model_dirs, adapters):
    """examples/vllm_offline.py, written against vLLM's offline API, runs on rollwise by its import alone."""
    import subprocess
    import sys
    got = subprocess.run([sys.executable, "examples/vllm_offline.py", model_dirs["qwen3"], adapters["qv"][0]],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    lines = got.stdout.splitlines()
    assert sum("sample" in x for x in lines) == 8 and any(x.startswith("with the adapter: [") for x in lines)
    assert any(x.startswith("chat: ") for x in lines) and any(x.startswith("looping reply: repetition after")
                                                              for x in lines)
    scored = [x for x in lines if x.startswith("scored with detokenize=")]  # (None: vLLM decodes nothing then)
    assert len(scored) == 2 and "pieces [None, None" in scored[0] and "None" not in scored[1].split("pieces")[1]
    assert sum(x.startswith("thinking budget ") and "'</think>' at output index" in x for x in lines) == 2
    assert lines[-1] == "logprob_token_ids: [[(40, 1), (41, 2)], [(40, 1), (41, 2)]]"


def test_async_llm_takes_lora_requests(model_dirs, adapters):
    """vLLM's AsyncLLM: a LoRARequest per request (loaded the first time), listed and removed by its id."""
    import asyncio

    from rollwise import AsyncLLM, LoRARequest
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(adapters["qv"][1], kv_cache_gb=0.05).generate(PROMPTS[:1], greedy)[0].token_ids
    base = LLM(model_dirs["qwen3"], kv_cache_gb=0.05).generate(PROMPTS[:1], greedy)[0].token_ids
    eng = AsyncLLM(model_dirs["qwen3"], enable_lora=True, kv_cache_gb=0.05)

    async def last(**kw):
        return [o async for o in eng.generate(PROMPTS[0], greedy, "r", **kw)][-1].token_ids

    async def go():
        assert await last(lora_request=LoRARequest("qv", 7, adapters["qv"][0])) == want
        assert await last() == base and await eng.list_loras() == {7}
        assert await eng.remove_lora(7) and not await eng.remove_lora(7) and await eng.list_loras() == set()
        with pytest.raises(ValueError, match="no lora_path"):
            await last(lora_request=LoRARequest("qv", 7))
    try:
        asyncio.run(go())
    finally:
        eng.shutdown()


def test_sglang_engine_serves_adapters_by_lora_path(model_dirs, adapters):
    """SGLang's offline engine: adapters from `lora_paths` at start or `load_lora_adapter`, picked per
    request by `lora_path` (in a batch one for all or one each), unloaded by name."""
    from rollwise import SGLangEngine
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    want = {n: LLM(m, kv_cache_gb=0.05).generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8,
                                                                            ignore_eos=True))
            for n, (_, m) in adapters.items()}
    with SGLangEngine(model_path=model_dirs["qwen3"], enable_lora=True, kv_cache_gb=0.05,
                      lora_paths=[f"qv={adapters['qv'][0]}"]) as eng:
        assert eng.generate(input_ids=PROMPTS[0], sampling_params=greedy, lora_path="qv")["output_ids"] == \
            want["qv"][0].token_ids
        got = eng.load_lora_adapter("all", adapters["all"][0])
        assert got["success"] and got["loaded_adapters"] == {"qv": adapters["qv"][0], "all": adapters["all"][0]}
        outs = eng.generate(input_ids=PROMPTS[:2], sampling_params=greedy, lora_path="all")
        assert [o["output_ids"] for o in outs] == [w.token_ids for w in want["all"]]
        outs = eng.generate(input_ids=PROMPTS[:2], sampling_params=greedy, lora_path=["all", "qv"])  # one each
        assert [o["output_ids"] for o in outs] == [want["all"][0].token_ids, want["qv"][1].token_ids]
        assert eng.unload_lora_adapter("all")["loaded_adapters"] == {"qv": adapters["qv"][0]}
        assert not eng.unload_lora_adapter("all")["success"]
        with pytest.raises(ValueError, match="unknown LoRA adapter"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=greedy, lora_path="all")


def test_a_vllm_async_worker_runs_as_written(model_dirs, adapters):
    """examples/vllm_async.py, a rollout worker written against vLLM's AsyncLLM, runs on rollwise."""
    import subprocess
    import sys
    got = subprocess.run([sys.executable, "examples/vllm_async.py", model_dirs["qwen3"], adapters["qv"][0]],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    lines = got.stdout.splitlines()
    assert sum(x.startswith("episode: ") for x in lines) == 4 and lines[-1].startswith("streamed 8 pieces: ")


def test_adapters_are_batch_invariant(model_dirs, adapters):
    """With batch_invariant the adapters' deltas take the same path as their linears: a request on an
    adapter gets the same bits alone as beside the base and other adapters, speculating or not."""
    d = model_dirs["qwen3"]
    kw = dict(enable_lora=True, kv_cache_gb=0.05, batch_invariant=True)
    names = ["all", None, "qv", "all"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True, lora=n) for i, n in enumerate(names)]
    engines = [LLM(d, **kw), LLM(d, speculative="suffix", spec_controller="always", **kw)]
    for llm in engines:
        for name, (path, _) in adapters.items():
            llm.engine.add_lora(name, path)
    alone = [engines[0].generate([p], q)[0] for p, q in zip(PROMPTS, params)]
    for llm in engines:
        for _ in range(2):
            outs = llm.generate(PROMPTS, params)
            assert [(o.token_ids, o.logprobs) for o in outs] == [(o.token_ids, o.logprobs) for o in alone]


def test_prefix_cache_keeps_adapters_apart_and_bad_adapters_are_refused(model_dirs, adapters, tmp_path):
    d = model_dirs["qwen3"]
    llm = LLM(d, enable_lora=True, max_loras=2, max_lora_rank=4, kv_cache_gb=0.05)
    with pytest.raises(ValueError, match="rank 8 is outside 1..max_lora_rank \\(4\\)"):
        llm.engine.add_lora("all", adapters["all"][0])
    llm.engine.add_lora("qv", adapters["qv"][0])
    sp = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([PROMPTS[0]], sp)
    a = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, lora="qv"))[0]
    assert a.num_cached_tokens == 0  # the base model's KV is not the adapter's
    assert llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, lora="qv"))[0].num_cached_tokens >= 16
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'; loaded: \\['qv'\\]"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, lora="nope"))
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        llm.engine.add_lora("x", str(tmp_path))
    with pytest.raises(ValueError, match="lora must be the name"):
        SamplingParams(lora=7)
    llm.engine.add_lora("qv2", adapters["qv"][0])
    with pytest.raises(ValueError, match="max_loras is 2"):
        llm.engine.add_lora("qv3", adapters["qv"][0])
    llm.engine.remove_lora("qv2")
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(d, kv_cache_gb=0.05).engine.add_lora("qv", adapters["qv"][0])


def test_adapters_over_http(model_dirs, adapters):
    """`rollwise serve --enable-lora --lora-modules`: chat and completions pick an adapter by `model`,
    /generate by SGLang's `lora_path`; adapters load and unload while serving, and list in /v1/models."""
    import asyncio

    import httpx

    from rollwise.router.replica import HttpReplica
    from rollwise.serve.process import ServerProcess
    from rollwise.types import GenerateRequest
    d = model_dirs["qwen3"]
    want = {n: LLM(m, kv_cache_gb=0.05).generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
            for n, (_, m) in adapters.items()}
    base = LLM(d, kv_cache_gb=0.05).generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    with ServerProcess(d, "--enable-lora", "--lora-modules", f"all={adapters['all'][0]}", threads=1) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        def completion(model):
            r = c.post("/v1/completions", json={"model": model, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        assert completion("all") == want["all"] and completion("whatever") == base

        async def via_replica():  # the router's HTTP client passes the adapter on
            r = HttpReplica(s.url)
            try:
                return (await r.generate(GenerateRequest(prompt_token_ids=PROMPTS[1], params=SamplingParams(
                    temperature=0, max_tokens=8, ignore_eos=True, lora="all")))).token_ids
            finally:
                await r.close()
        assert asyncio.run(via_replica()) == want["all"]
        assert [m["id"] for m in c.get("/v1/models").json()["data"]][1:] == ["all"]
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": adapters["qv"][0]}).status_code == 200
        g = c.post("/generate", json={"input_ids": PROMPTS[1], "lora_path": "qv",
                                      "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
        assert g.json()["token_ids"] == want["qv"]
        chat = c.post("/v1/chat/completions", json={"model": "qv", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 4})
        assert chat.status_code == 200
        assert c.post("/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 200
        bad = c.post("/generate", json={"input_ids": PROMPTS[1], "lora_path": "qv"})
        assert bad.status_code == 400 and "unknown LoRA adapter 'qv'" in bad.json()["error"]["message"]
        bad = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and "not a LoRA adapter" in bad.json()["error"]["message"]


def test_adapters_through_the_route(model_dirs, adapters):
    """`rollwise route`: an adapter loaded through it goes to every replica (and to one added later),
    and its name picks it in chat and completions there too."""
    import subprocess
    import sys
    import time

    import httpx

    from rollwise.serve.process import ServerProcess, free_port
    d = model_dirs["qwen3"]
    want = LLM(adapters["qv"][1], kv_cache_gb=0.05).generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with ServerProcess(d, "--enable-lora", threads=1) as a, ServerProcess(d, "--enable-lora", threads=1) as b:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "rollwise.cli", "route", "--port", str(port), "--tokenizer", d,
                                 "--replica", a.url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(100):
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            with httpx.Client(base_url=url, timeout=60) as c:
                r = c.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": adapters["qv"][0]})
                assert r.status_code == 200 and r.json()["replicas"] == 1, r.text
                assert c.post("/replicas", json={"url": b.url}).status_code == 200
                assert "qv" in [m["id"] for m in httpx.get(b.url + "/v1/models").json()["data"]]  # loaded on joining
                out = c.post("/v1/completions", json={"model": "qv", "prompt": PROMPTS[1], "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                assert out.json()["choices"][0]["token_ids"] == want[0].token_ids, out.text
                chat = c.post("/v1/chat/completions", json={"model": "qv", "max_tokens": 3,
                                                            "messages": [{"role": "user", "content": "hi"}]})
                assert chat.status_code == 200, chat.text
                assert c.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).json()["replicas"] == 2
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _adapter_weights(path: str):
    from rollwise.engine.lora import read_adapter
    from rollwise.wire import AdapterWeights
    return AdapterWeights(*read_adapter(path))


def test_an_adapter_as_a_weights_version(model_dirs, adapters):
    """update_weights with an adapter: a new policy version that is the held weights plus the adapter,
    without a copy of the weights; requests pinned to each held version get that version's adapter
    (or none), and a full update afterwards is a version of its own again."""
    d = model_dirs["qwen3"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = {n: LLM(m, kv_cache_gb=0.05).generate([PROMPTS[2]], greedy)[0].token_ids for n, (_, m) in adapters.items()}
    base = LLM(d, kv_cache_gb=0.05).generate([PROMPTS[2]], greedy)[0].token_ids
    llm = LLM(d, enable_lora=True, keep_weight_versions=3, kv_cache_gb=0.05)
    eng = llm.engine
    assert eng.update_weights(_adapter_weights(adapters["all"][0]), 1) == 1
    assert eng.update_weights(adapters["qv"][0], 2) == 2  # (a peft directory works too)
    assert len({id(m) for m in eng.runner.versions.values()}) == 1  # three versions, one copy of the weights

    def at(v):
        rid = eng.add_request(PROMPTS[2], greedy, policy_version=v)
        while eng.has_unfinished:
            for o in eng.step():
                if o.request_id == rid:
                    return o
    assert at(0).token_ids == base and at(1).token_ids == want["all"] and at(2).token_ids == want["qv"]
    assert at(1).policy_version == 1
    state = {k: v.clone() for k, v in eng.runner.model.hf_tensors().items()}
    eng.update_weights(state, 3)  # full weights (the same values): a copy of its own, no adapter
    assert at(3).token_ids == base and at(2).token_ids == want["qv"]
    assert eng.runner.versions[3] is not eng.runner.versions[2]
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(d, kv_cache_gb=0.05).engine.update_weights(adapters["qv"][0], 1)


def test_adapter_updates_over_http(model_dirs, adapters):
    """An HTTP replica takes a LoRA run's adapter update streamed (safetensors + lora_config) and
    through a shared directory (peft's layout)."""
    import asyncio

    from rollwise.router.replica import HttpReplica
    from rollwise.serve.process import ServerProcess
    from rollwise.types import GenerateRequest
    d = model_dirs["qwen3"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = {n: LLM(m, kv_cache_gb=0.05).generate([PROMPTS[1]], greedy)[0].token_ids for n, (_, m) in adapters.items()}
    with ServerProcess(d, "--enable-lora", threads=1) as s:
        async def go():
            got = []
            for via, name, v in (("stream", "all", 1), ("file", "qv", 2)):
                r = HttpReplica(s.url, weights_via=via)
                try:
                    assert await r.update_weights(_adapter_weights(adapters[name][0]), v) == v
                    out = await r.generate(GenerateRequest(prompt_token_ids=PROMPTS[1], params=greedy))
                    got.append((out.token_ids, out.policy_version))
                finally:
                    await r.close()
            return got
        assert asyncio.run(go()) == [(want["all"], 1), (want["qv"], 2)]
