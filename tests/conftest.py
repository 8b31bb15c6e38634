from __future__ import annotations

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

import json  # noqa: E402

import pytest  # noqa: E402

from rollwise.make_model import make_model  # noqa: E402

# std 0.1 gives peaked enough logits that greedy ties (where fp32 noise could flip a token) are rare
FAMILIES = {
    "llama": dict(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024, std=0.1),
    "qwen2": dict(family="qwen2", layers=2, hidden=64, heads=4, kv_heads=1, vocab=1024, std=0.1, seed=1),
    "qwen3": dict(family="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024, std=0.1, seed=2,
                  tie=True, head_dim=32),
    "qwen3_moe": dict(family="qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024, std=0.1, seed=3,
                      experts=8, experts_per_token=2, moe_intermediate=48),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: str(make_model(root / name, **kw)) for name, kw in FAMILIES.items()}


@pytest.fixture(scope="session")
def model_dir(model_dirs) -> str:
    return model_dirs["qwen3"]


@pytest.fixture(scope="session")
def other_dir(tmp_path_factory) -> str:
    """The test model's shape (qwen3 above) with other weights: what a trainer's step sends."""
    return str(make_model(tmp_path_factory.mktemp("other"), **FAMILIES["qwen3"] | {"seed": 7}))


@pytest.fixture(scope="session")
def rm_dir(model_dir, tmp_path_factory) -> str:
    """A reward model on the test model's weights (Qwen3ForSequenceClassification, a random score head)."""
    from rollwise.make_model import make_reward_model
    return str(make_reward_model(model_dir, tmp_path_factory.mktemp("rm")))


@pytest.fixture(autouse=True, scope="module")
def _free_engines():
    """Engines a module's tests made (each holds its KV pool's used pages, up to 1 GB by default) freed
    before the next module's, reference cycles included: the suite runs in one process."""
    yield
    import gc
    gc.collect()


# Bad input: every field of a valid body (nested ones too) replaced by values of other types
# ("\ud800": a lone surrogate, which JSON's escapes can spell and no tokenizer takes)
JUNK = [None, True, -1, 2**63, 1.5, "x", [], {}, [10**9], [{"x": 1}], "\ud800"]
VALID = {  # a body of each kind, with a field of every kind; each field is replaced by each JUNK value in turn
    "/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "top_k": 5, "top_p": 0.9, "seed": 1,
                                                             "stop": ["a"], "stop_token_ids": [5], "min_tokens": 1,
                                                             "logit_bias": {"5": 1.0}, "logprobs": 1}},
    "/v1/chat/completions": {"messages": [{"role": "developer", "content": [{"type": "text", "text": "s"}]},
                                          {"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": None, "tool_calls": [
                                              {"id": "c", "type": "function",
                                               "function": {"name": "f", "arguments": "{}"}}]},
                                          {"role": "tool", "tool_call_id": "c", "content": "r"}],
                             "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                 "type": "object", "properties": {}}}}],
                             "tool_choice": {"type": "function", "function": {"name": "f"}}, "max_tokens": 3},
    "/collective_rpc": {"method": "compute_weight_checksums", "args": [], "kwargs": {}, "timeout": 60},
    "/update_weight_version": {"new_version": "v"},
    "/inference/v1/generate": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "n": 2, "logprobs": 1,
                                                                          "stop": ["a"], "seed": 1},
                               "stream_options": {"include_usage": True}, "priority": 0, "request_id": "r"},
    "/weight_checker": {"action": "compare", "baseline": {"a": "b"}},
    "/v1/responses": {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 3,
                      "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                      "text": {"format": {"type": "json_object"}}},
}


def _fields(obj, at=()):
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield at + (k,)
        yield from _fields(v, at + (k,))


def _with(body, at, value):
    body = json.loads(json.dumps(body))
    inner = body
    for k in at[:-1]:
        inner = inner[k]
    inner[at[-1]] = value
    return body


@pytest.fixture(scope="session")
def junk_failures():
    """`(client, path) -> failures`: VALID[path] (answered 200), then each of its fields replaced by each
    JUNK value; a failure is a reply that is a 5xx or a 4xx without a JSON error message."""
    def check(client, path: str) -> list:
        ok = client.post(path, json=VALID[path])
        assert ok.status_code == 200, ok.text
        failed = []
        for at in _fields(VALID[path]):
            for value in JUNK:
                r = client.post(path, content=json.dumps(_with(VALID[path], at, value)),
                                headers={"content-type": "application/json"})
                if r.status_code >= 500 or r.status_code >= 400 and "message" not in r.json()["error"]:
                    failed.append((at, value, r.status_code, r.text[:200]))
        return failed
    return check
