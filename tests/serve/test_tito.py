"""vLLM 0.32's token-in-token-out API (POST /inference/v1/generate) on a real `rollwise serve`."""
from __future__ import annotations

import base64
import io
import json

import numpy as np

from rollwise.wire import from_npy64

GEN = "/inference/v1/generate"
IDS = [5, 6, 7, 8, 9, 10]


def _events(text: str) -> list:
    """An SSE body's data lines, parsed; the last must be [DONE]."""
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_tokens_in_tokens_out_as_vllm_shapes_them(client):
    """Greedy ids equal the engine's own /generate; logprobs list each token (with its rank) then the
    most likely, max(k, 1) entries, as vLLM enumerates them; usage and the prompt's ids when asked."""
    sp = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    want = client.post("/generate", json={"input_ids": IDS, "sampling_params": sp | {"logprobs": 3}}).json()
    got = client.post(GEN, json={"token_ids": IDS, "sampling_params": sp | {"logprobs": 2}, "return_token_ids": True,
                                 "request_id": "abc"}).json()
    (c,) = got["choices"]
    assert c["token_ids"] == want["token_ids"] and c["finish_reason"] == "length" and c["index"] == 0
    assert got["request_id"] == "generate-tokens-abc" and got["output_mode"] == "tokens"
    assert got["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12,
                            "prompt_tokens_details": None, "completion_tokens_details": None}
    assert got["prompt_token_ids"] == IDS and got["prompt_logprobs"] is None
    for t, lp, top, pos in zip(want["token_ids"], want["logprobs"], want["top_logprobs"], c["logprobs"]["content"]):
        assert pos["token_id"] == t and abs(pos["logprob"] - lp) < 1e-5
        assert pos["rank"] == 1  # (greedy: the most likely)
        assert [e["token_id"] for e in pos["top_logprobs"]] == [t] + [x for x, _ in top if x != t][:1]
    zero = client.post(GEN, json={"token_ids": IDS, "sampling_params": sp | {"logprobs": 0}}).json()
    assert [len(p["top_logprobs"]) for p in zero["choices"][0]["logprobs"]["content"]] == [1] * 6
    hot = client.post(GEN, json={"token_ids": IDS, "sampling_params": sp | {"temperature": 1.0, "seed": 1,
                                                                            "max_tokens": 24, "logprobs": 1}}).json()
    ranks = [p["rank"] for p in hot["choices"][0]["logprobs"]["content"]]  # sampled: ranks in the vocabulary
    assert all(isinstance(r, int) and r >= 1 for r in ranks) and max(ranks) > 1
    plain = client.post(GEN, json={"token_ids": IDS, "sampling_params": sp}).json()
    assert plain["choices"][0]["logprobs"] is None and plain["prompt_token_ids"] is None


def test_n_samples_prompt_logprobs_and_text_mode(client):
    sp = {"temperature": 1.0, "seed": 3, "max_tokens": 8, "ignore_eos": True, "n": 3, "prompt_logprobs": 1}
    a = client.post(GEN, json={"token_ids": IDS, "sampling_params": sp}).json()
    b = client.post(GEN, json={"token_ids": IDS, "sampling_params": sp, "output_mode": "text"}).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]  # seeded: reproducible
    assert len({tuple(c["token_ids"]) for c in a["choices"]}) > 1  # sample j is seeded seed + j
    assert a["usage"]["completion_tokens"] == 24 and a["usage"]["prompt_tokens"] == 6
    pl = a["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(IDS)
    for t, pos in zip(IDS[1:], pl[1:]):  # the prompt's token (with its rank in the vocabulary) and the most likely
        assert str(t) in pos and pos[str(t)]["rank"] >= 1 and pos[str(t)]["logprob"] <= 0
    for c in b["choices"]:
        assert isinstance(c["text"], str) and c["text"]
        assert client.post("/detokenize", json={"tokens": c["token_ids"]}).json()["prompt"] == c["text"]


def test_a_teachers_scores_of_given_tokens_at_each_prompt_row(client):
    """prompt_logprob_token_ids (vLLM 0.32): each prompt row's ids scored, sent as base64 .npy
    [rows, ids]; equal to the prompt's own logprobs where the ids are its tokens; refused streamed."""
    own = client.post(GEN, json={"token_ids": IDS, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}}).json()
    rows = [[IDS[p + 1], 3, -1] for p in range(1, len(IDS) - 1)]  # from row 1: the prompt's token, token 3, padding
    sp = {"max_tokens": 1, "prompt_logprob_token_ids": rows, "prompt_logprob_start": 1}
    got = client.post(GEN, json={"token_ids": IDS, "sampling_params": sp}).json()
    scores = from_npy64(got["prompt_token_id_logprobs"])
    assert scores.shape == (len(IDS) - 2, 3) and scores.dtype == np.float32 and got["prompt_logprobs"] is None
    for i, p in enumerate(range(1, len(IDS) - 1)):
        assert abs(scores[i, 0] - own["prompt_logprobs"][p + 1][str(IDS[p + 1])]["logprob"]) < 1e-5
        assert scores[i, 1] < 0 and np.isneginf(scores[i, 2])
    r = client.post(GEN, json={"token_ids": IDS, "stream": True, "sampling_params": {
        "max_tokens": 1, "prompt_logprob_token_ids": rows, "prompt_logprob_start": 1}})
    assert r.status_code == 400 and "not available when stream=true" in r.json()["error"]["message"]
    r = client.post(GEN, json={"token_ids": IDS, "sampling_params": {"prompt_logprob_token_ids": rows}})
    assert r.status_code == 400 and "has 4 rows, but the prompt has 5 scored rows" in r.json()["error"]["message"]


def test_streamed_chunks_add_up_to_the_reply(client):
    sp = {"temperature": 0, "max_tokens": 7, "ignore_eos": True, "n": 2, "logprobs": 1}
    whole = client.post(GEN, json={"token_ids": IDS, "sampling_params": sp}).json()
    r = client.post(GEN, json={"token_ids": IDS, "sampling_params": sp, "stream": True, "return_token_ids": True,
                               "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[0]["prompt_token_ids"] == IDS and all("prompt_token_ids" not in e for e in events[1:])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 14
    for c in whole["choices"]:
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == c["index"]]
        assert sum((m["token_ids"] for m in mine), []) == c["token_ids"]
        assert sum((m["logprobs"]["content"] for m in mine), []) == c["logprobs"]["content"]
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + ["length"]


def test_weight_labels_and_bad_requests(client):
    assert client.post("/update_weight_version", json={"new_version": "step-7"}).status_code == 200
    got = client.post(GEN, json={"token_ids": IDS, "sampling_params": {"max_tokens": 3, "temperature": 0,
                                                                        "ignore_eos": True}}).json()
    assert got["choices"][0]["weight_versions"] == [{"version": "step-7", "start": 0, "end": 3}]
    for body, why in [({"token_ids": []}, "token_ids"),
                      ({"token_ids": IDS, "features": {"mm_hashes": {}}}, "features: not taken here"),
                      ({"token_ids": IDS, "sampling_params": {"bogus": 1}}, "unknown sampling fields ['bogus']"),
                      ({"token_ids": IDS, "sampling_params": {"n": 0}}, "n must be"),
                      ({"token_ids": IDS, "output_mode": "bytes"}, "output_mode"),
                      ({"token_ids": [10 ** 9]}, "token"),
                      ({"token_ids": [10 ** 9], "stream": True}, "token"),  # streamed: a 400 before the stream
                      ({"token_ids": IDS, "stream": True, "sampling_params": {"bad_words": [""]}}, "bad_words")]:
        r = client.post(GEN, json=body)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (body, r.text)
    assert client.post(GEN, json={"token_ids": IDS}).status_code == 200  # (it serves on)


def test_junk_in_any_field_is_a_4xx_never_a_500(client, junk_failures):
    assert junk_failures(client, GEN) == []


def test_npy_base64_is_vllms_encoding():
    from rollwise.wire import npy64
    a = np.arange(12, dtype=np.int32).reshape(2, 3, 2)
    assert (np.load(io.BytesIO(base64.b64decode(npy64(a))), allow_pickle=False) == a).all()
    assert (from_npy64(npy64(a)) == a).all() and from_npy64(npy64(a)).dtype == np.int32
