"""vLLM's tokenizer endpoints on `rollwise serve` and `rollwise route`: `POST /tokenize` (a prompt,
or a chat rendered by the server's chat template exactly as /v1/chat/completions renders it, so a
token-in-token-out client gets the ids the server would generate from), `POST /detokenize`, and
`GET /version`."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import Field

from rollwise.serve.protocol import ChatMessage, _Strict


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None  # a completion's prompt, or:
    messages: list[ChatMessage] | None = None  # a chat, rendered by the chat template
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # (as chat's: needs --trust-request-chat-template)
    add_special_tokens: bool = True  # (a prompt's: the tokenizer's own, e.g. a BOS)
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def install_tokenize(app: FastAPI, tokenizer, defaults, max_model_len: int | None) -> None:
    """`tokenizer`: the server's (None: a router without one, refused); `defaults`: its chat
    template's keyword arguments (rollwise.serve.defaults)."""
    from rollwise import __version__

    def tok():
        if tokenizer is None:
            raise ValueError("this router has no tokenizer to tokenize with (start it with --tokenizer)")
        return tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("give prompt (a text) or messages (a chat), one of them")
        if body.messages is not None:
            tok()  # (a router without a tokenizer: refused)
            ids = defaults.renderer(body).encode_chat([m.model_dump(exclude_none=True) for m in body.messages],
                                                      body.add_generation_prompt, body.tools,
                                                      body.continue_final_message, **defaults.kwargs(body))
        else:
            ids = tok().encode(body.prompt, add_special_tokens=body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tok().decode([t], skip_special_tokens=False) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        vocab = tok().vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are not in the vocabulary (0 to {vocab - 1})")
        return {"prompt": tok().decode(body.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version():
        return {"version": __version__}
