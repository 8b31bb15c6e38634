"""What a server takes when a request leaves it out (rollwise.serve.defaults, vLLM's options):
`--chat-template`, `--default-chat-template-kwargs` and the model's generation config; a request's own
`chat_template` with `--trust-request-chat-template`."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from rollwise.config import ServerConfig
from rollwise.engine.tokenizer import Tokenizer
from rollwise.serve.process import ServerProcess

OWN = "[{% for m in messages %}{{ m.role }}={{ m.content }}{% endfor %}]{% if add_generation_prompt %}>{% endif %}"
TEMPLATE = ("{{ greeting }}|{% for m in messages %}{{ m.role }}: {{ m.content }}|{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tuned_dir(model_dir, tmp_path_factory) -> str:
    """The test model with sampling defaults in its generation_config.json (greedy, 5 new tokens, a
    repetition penalty)."""
    out = tmp_path_factory.mktemp("tuned") / "m"
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(cfg | {"temperature": 0.0, "max_new_tokens": 5,
                                                                  "top_k": 1, "repetition_penalty": 1.3}))
    return str(out)


def test_the_model_generation_config_and_the_servers_template_fill_what_requests_leave_out(tuned_dir, tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    msgs = [{"role": "user", "content": "Hello"}]
    tok = Tokenizer(tuned_dir)
    with ServerProcess(tuned_dir, "--chat-template", str(tmp_path / "t.jinja"),
                       "--default-chat-template-kwargs", '{"greeting": "Ahoy"}') as s:
        post = lambda path, body: httpx.post(s.url + path, json=body, timeout=60).json()  # noqa: E731
        chat = {"messages": msgs, "return_token_ids": True, "ignore_eos": True}
        a, b = post("/v1/chat/completions", chat), post("/v1/chat/completions", chat | {"seed": 9})
        greedy = post("/v1/chat/completions", chat | {"temperature": 0.0})
        # greedy and 5 tokens, from the generation config; the prompt rendered by the server's template
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
        assert a["usage"]["completion_tokens"] == 5
        assert a["prompt_token_ids"] == tok.encode("Ahoy|user: Hello|assistant:", add_special_tokens=False)
        own = post("/v1/chat/completions", chat | {"chat_template_kwargs": {"greeting": "Hi"}, "max_tokens": 3})
        assert own["prompt_token_ids"] == tok.encode("Hi|user: Hello|assistant:", add_special_tokens=False)
        assert own["usage"]["completion_tokens"] == 3  # what a request sets is its own
        r = httpx.post(s.url + "/v1/chat/completions", json=chat | {"chat_template_kwargs": {"tools": []}}, timeout=60)
        assert r.status_code == 400 and "cannot set ['tools']" in r.json()["error"]["message"]
        hot = [post("/v1/chat/completions", chat | {"temperature": 1.0, "seed": k, "max_tokens": 12})
               for k in range(4)]  # (still the config's top_k 1: greedy)
        assert len({tuple(h["choices"][0]["token_ids"]) for h in hot}) == 1
        hot = [post("/v1/chat/completions", chat | {"temperature": 1.0, "seed": k, "max_tokens": 12, "top_k": 0})
               for k in range(4)]  # (top_k off, as the request says)
        assert len({tuple(h["choices"][0]["token_ids"]) for h in hot}) > 1
        assert post("/v1/completions", {"prompt": [5, 6, 7], "ignore_eos": True})["usage"]["completion_tokens"] == 5
        counted = post("/v1/messages/count_tokens", {"model": "m", "messages": msgs})["input_tokens"]
        assert counted == len(a["prompt_token_ids"])
        assert post("/tokenize", {"messages": msgs})["tokens"] == a["prompt_token_ids"]  # (vLLM's /tokenize too)
        r = httpx.post(s.url + "/v1/chat/completions", json=chat | {"chat_template": OWN}, timeout=60)
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
    with ServerProcess(tuned_dir, "--trust-request-chat-template") as s:  # vLLM's: a request's own template taken
        post = lambda path, body: httpx.post(s.url + path, json=body, timeout=60)  # noqa: E731
        chat = {"messages": msgs, "return_token_ids": True, "max_tokens": 2}
        own = post("/v1/chat/completions", chat | {"chat_template": OWN}).json()
        assert own["prompt_token_ids"] == tok.encode("[user=Hello]>", add_special_tokens=False)
        assert post("/tokenize", {"messages": msgs, "chat_template": OWN}).json()["tokens"] == own["prompt_token_ids"]
        plain = post("/v1/chat/completions", chat).json()  # the next request: the model's template again
        assert plain["prompt_token_ids"] == tok.encode_chat(msgs)
        docs = {"chat_template": "{% for d in documents %}<{{ d.title }}>{% endfor %}" + OWN,
                "documents": [{"title": "Paris", "text": "capital"}, {"title": "Rome", "text": "also"}]}
        assert post("/v1/chat/completions", chat | docs).json()["prompt_token_ids"] == tok.encode(
            "<Paris><Rome>[user=Hello]>", add_special_tokens=False)  # (vLLM's documents, for RAG templates)
        r = post("/v1/chat/completions", chat | {"chat_template": "{% for m in messages %}"})
        assert r.status_code == 400 and "not a Jinja template" in r.json()["error"]["message"]
    with ServerProcess(tuned_dir, "--generation-config", "vllm") as s:  # OpenAI's defaults
        got = httpx.post(s.url + "/v1/completions", json={"prompt": [5, 6, 7], "ignore_eos": True}, timeout=60).json()
        assert got["usage"]["completion_tokens"] == 16


def test_server_defaults_name_their_problems(tmp_path):
    with pytest.raises(ValueError, match="must be a JSON object"):
        ServerConfig(default_chat_template_kwargs="[1]")
    with pytest.raises(ValueError, match="cannot set \\['tools'\\]"):
        ServerConfig(default_chat_template_kwargs='{"tools": []}')
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        ServerConfig(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="'auto', 'vllm' or a folder"):
        ServerConfig(generation_config=str(tmp_path / "nowhere"))
    assert ServerConfig(chat_template="{{ messages }}").chat_template == "{{ messages }}"
    with pytest.raises(ValueError, match="is not a Jinja template"):  # (at the start, not the first chat)
        ServerConfig(chat_template="{% for m in messages %}")


def test_an_openai_api_replica_sends_every_sampling_field(tuned_dir):
    """The router's OpenAI-API replica (for vLLM, whose default also fills missing fields from the
    generation config) sends each field, off or on, so the server samples from the distribution the
    trainer assumes: the same tokens and logprobs as /generate, which takes no such defaults."""
    import asyncio

    from rollwise.router.openai_replica import OpenAIReplica
    from rollwise.router.replica import HttpReplica
    from rollwise.types import GenerateRequest, SamplingParams
    req = GenerateRequest(prompt_token_ids=[11, 12, 13, 14], params=SamplingParams(
        temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))
    with ServerProcess(tuned_dir) as s:
        async def go():
            return [await r.generate(req) for r in (OpenAIReplica(s.url, "m"), HttpReplica(s.url))]
        via_openai, via_generate = asyncio.run(go())
    assert via_openai.token_ids == via_generate.token_ids and len(set(via_openai.token_ids)) > 1
    assert via_openai.logprobs == pytest.approx(via_generate.logprobs, abs=1e-5)
