"""Tokenizer of a Hugging Face model directory (tokenizer.json + tokenizer_config.json), with its
chat template rendered by jinja2 the way transformers renders it. No transformers import."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


def eos_ids(model_dir: str | Path, config_ids, tokenizer: Tokenizer) -> set[int]:
    """The ids a model's output ends at: its config's, generation_config.json's and the tokenizer's EOS."""
    ids = set(config_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [] if e is None else [e])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        d = self.model_dir = Path(model_dir)
        if not (d / "tokenizer.json").exists():
            raise ValueError(f"{d} has no tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template = self.config.get("chat_template")
        tmpl_file = d / "chat_template.jinja"
        if self.chat_template is None and tmpl_file.exists():
            self.chat_template = tmpl_file.read_text()
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size()
        self._template = None

    def set_chat_template(self, template: str) -> None:
        """Render chats with this Jinja template instead of the tokenizer's (`--chat-template`)."""
        self.chat_template, self._template = template, None

    def with_chat_template(self, template: str) -> Tokenizer:
        """A copy that renders chats with `template` (a call's or request's own); this one keeps its own."""
        tok = copy.copy(self)
        tok.set_chat_template(template)
        return tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # tokenizers' "TextInputSequence must be str" for a lone surrogate, which JSON can spell
            if isinstance(text, str) and not _is_unicode(text):
                raise ValueError("the text is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)") from None
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def bad_word_ids(self, words) -> list[list[int]]:
        """vLLM's bad_words as token ids: each word as written and after a space (its two spellings), once each."""
        if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError("bad_words must be a list of non-empty strings")
        out = []
        for w in words:
            for spelled in (w.lstrip(), " " + w.lstrip()):
                ids = self.encode(spelled, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def decoder(self, skip_special_tokens: bool = True):
        """An output's text as it grows: each call takes the new ids and gives the new text, a
        character split across tokens once it is whole (tokenizers' DecodeStream). A step costs the
        same however long the output is; decoding the whole output at every step of a stream made
        it quadratic (a 32,000-token reply: about 80 s; benchmarks/stream_decode.py)."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda ids: "".join(c for i in ids if (c := stream.step(self._tok, i)) is not None)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def added_token_id(self, token: str) -> int | None:
        """The id of `token` if the tokenizer adds it to its vocabulary (special tokens, and tags such
        as Qwen's <tool_call>), else None."""
        return next((i for i, t in self._tok.get_added_tokens_decoder().items() if t.content == token), None)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; send a plain prompt instead")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "", **kwargs)
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError, IndexError) as e:
            # what the client sent does not fit the template (a field of the wrong type or shape)
            raise ValueError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, continue_final_message: bool = False,
                    add_special_tokens: bool = False, **kwargs) -> list[int]:
        """The chat's prompt ids; `kwargs`: more of the template's variables (`enable_thinking`: a
        request's `chat_template_kwargs`). `continue_final_message`: the last message, an
        assistant's, is left open for the reply to go on writing (a prefill), as transformers does:
        the rendering is cut where that message's text ends."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        if continue_final_message:
            final = messages[-1] if messages else {}
            if final.get("role") != "assistant" or not isinstance(final.get("content"), str):
                raise ValueError("continue_final_message needs a last message from the assistant, with text")
            for piece in (final["content"], final["content"].strip()):
                at = text.rfind(piece)
                if at >= 0:
                    text = text[:at + len(piece)]
                    break
            else:
                raise ValueError("the chat template does not write the final message's text as it is: it cannot "
                                 "be continued")
        return self.encode(text, add_special_tokens=add_special_tokens)  # (the template writes the BOS it wants)


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):  # AddedToken serialised by transformers
        return tok.get("content")
    return tok


def compile_template(text: str):
    """A chat template compiled as transformers compiles it (a sandbox; `tojson`, `raise_exception`);
    ValueError, naming the line, for one that does not parse."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not a Jinja template: {e} (line {e.lineno})") from None


def _raise(msg: str):
    raise ValueError(f"chat template error: {msg}")


def _is_unicode(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (a str holding a lone surrogate does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
