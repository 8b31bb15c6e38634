"""What `rollwise serve` and `rollwise route` take from the command line or the model when a request
leaves it out, as vLLM does: the chat template (`--chat-template`, a file or the template itself,
in place of the tokenizer's), its keyword arguments (`--default-chat-template-kwargs`, JSON, under
a request's `chat_template_kwargs`) and the sampling fields of the model's generation_config.json
(`--generation-config auto`, the default: temperature, top_p, top_k, min_p, repetition_penalty
and max_new_tokens as max_tokens, for OpenAI requests that do not set them; `vllm`: none; or a
folder holding a generation_config.json). A request's own `chat_template` is taken only from a
server started with `--trust-request-chat-template`, as in vLLM."""
from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

RESERVED = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}  # the template's own inputs
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # HF's -> ours


def template_text(value: str) -> str:
    """`--chat-template`: a file's text, or the template itself (anything with a `{`); one that does
    not parse stops the server at its start, not its first chat."""
    from rollwise.engine.tokenizer import compile_template
    path = Path(value)
    if not path.is_file() and "{" not in value:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    text = path.read_text() if path.is_file() else value
    compile_template(text)
    return text


def template_kwargs(value: str | None) -> dict:
    if value is None:
        return {}
    try:
        got = json.loads(value)
    except ValueError:
        got = None
    if not isinstance(got, dict):
        raise ValueError(f"default_chat_template_kwargs must be a JSON object, got {value!r}")
    if set(got) & RESERVED:
        raise ValueError(f"default_chat_template_kwargs cannot set {sorted(set(got) & RESERVED)}")
    return got


def sampling_defaults(setting: str, model_dir: str | Path | None) -> dict:
    """Our SamplingParams fields -> the generation config's values (only those it sets)."""
    if setting == "vllm" or (setting == "auto" and model_dir is None):
        return {}
    folder = Path(model_dir) if setting == "auto" else Path(setting)
    f = folder / "generation_config.json"
    if not f.is_file():
        if setting == "auto":
            return {}
        raise ValueError(f"generation_config: {folder} has no generation_config.json (valid: 'auto', 'vllm' "
                         "or such a folder)")
    cfg = json.loads(f.read_text())
    return {ours: cfg[hf] for hf, ours in GENERATION_FIELDS.items() if cfg.get(hf) is not None}


class Defaults:
    """A server's defaults, read once at its start; the tokenizer's template replaced if one is given."""

    def __init__(self, cfg, tokenizer) -> None:
        if tokenizer is not None and cfg.chat_template is not None:
            tokenizer.set_chat_template(template_text(cfg.chat_template))
        self.template_kwargs = template_kwargs(cfg.default_chat_template_kwargs)
        self.sampling = sampling_defaults(cfg.generation_config, getattr(tokenizer, "model_dir", None))
        self.tokenizer, self.trust_request_template = tokenizer, cfg.trust_request_chat_template
        self._templated: OrderedDict[str, object] = OrderedDict()  # a request's template -> a tokenizer rendering it

    def renderer(self, body):
        """The tokenizer that renders a chat request: the server's, or where the server trusts them
        (vLLM's --trust-request-chat-template) a copy that renders the request's own `chat_template`
        (the last 8 such kept, compiled)."""
        text = getattr(body, "chat_template", None)
        if text is None:
            return self.tokenizer
        if not self.trust_request_template:
            raise ValueError("a request's chat_template needs the server started with --trust-request-chat-template "
                             "(as in vLLM: the template is code the server runs)")
        tok = self._templated.pop(text, None) or self.tokenizer.with_chat_template(text)
        self._templated[text] = tok
        while len(self._templated) > 8:
            self._templated.popitem(last=False)
        return tok

    def kwargs(self, body) -> dict:
        """A chat request's template keyword arguments: the server's, then the request's (its
        `reasoning_effort` too, and its `documents`, for templates that read them)."""
        got = {**self.template_kwargs, **(body.chat_template_kwargs or {})}
        if getattr(body, "reasoning_effort", None) is not None:
            got.setdefault("reasoning_effort", body.reasoning_effort)
        if getattr(body, "documents", None) is not None:
            got["documents"] = body.documents
        taken = sorted(set(got) & RESERVED)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {taken}: the request itself says them")
        return got
