"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regular
expression, one of several strings, or a Lark grammar (`SamplingParams.structured_outputs`, vLLM's
names), by masking at every step the tokens that could not continue a valid output.

The grammar engine is llguidance (Rust; what vLLM and SGLang use as one of their backends): a
matcher per request, its allowed tokens computed as a bitmask before sampling and advanced by each
token sampled. The logprobs are those of the masked distribution (as with logit_bias). A request
with a grammar is not speculated on (drafts are proposed for the others in the batch). JSON is
compact (no whitespace between tokens: a small model given the choice can spend its tokens on
blanks); a schema's `"x-guidance": {"whitespace_flexible": true}` allows it, as llguidance reads it.
llguidance takes every added token as a special token, which a Lark grammar names in angle
brackets (`<tool_call>`, `<|im_end|>`), not as a string literal.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch


def to_grammar(spec: dict) -> str:
    """The llguidance grammar of a spec `rollwise.types.check_structured` has checked."""
    import llguidance
    (kind, value), = spec.items()
    if kind in ("json", "json_object"):  # compact unless the schema's "x-guidance" says otherwise
        return llguidance.LLMatcher.grammar_from_json_schema(value if kind == "json" else {"type": "object"},
                                                            defaults={"whitespace_flexible": False})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in value))
    return llguidance.LLMatcher.grammar_from_lark(value)


class Grammars:
    """Matchers for one model's tokenizer (built once, on the first request that needs it)."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer_dir, self.vocab_size, self.eos_token_ids = Path(tokenizer_dir), vocab_size, sorted(eos_token_ids)
        self._tokenizer = None
        self._special: torch.Tensor | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance
            self._tokenizer = llguidance.LLTokenizer((self.tokenizer_dir / "tokenizer.json").read_text(),
                                                     n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._tokenizer

    @property
    def special(self) -> torch.Tensor:
        """The ids llguidance takes as special tokens (every added token, and ids past the tokenizer's)."""
        if self._special is None:
            tok = self.tokenizer
            self._special = torch.tensor([t for t in range(self.vocab_size) if t >= tok.vocab_size
                                          or tok.is_special_token(t)], dtype=torch.long)
        return self._special

    def matcher(self, spec: dict):
        """A fresh matcher for a request; ValueError if the grammar does not compile."""
        import llguidance
        try:
            grammar = to_grammar(spec)
        except Exception as e:  # noqa: BLE001 - llguidance's own error types: the request's fault
            raise ValueError(f"structured_outputs: {e}") from None
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)  # (errors: get_error, stop reasons)
        if m.is_error():
            raise ValueError(f"structured_outputs: {m.get_error()}")
        return m


def allowed(matchers: list, vocab: int, special: torch.Tensor | None = None) -> torch.Tensor:
    """[len(matchers), vocab] bool: the tokens each matcher allows next (EOS once its output is
    complete), computed for the batch at once (llguidance's executor, without the GIL). The mask
    can let through a special token whose text fits (Qwen's <tool_call> inside a JSON string) that
    the matcher would then refuse: `special` ones it lets through are checked one by one."""
    import llguidance.torch as lt
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance
        _EXECUTOR = llguidance.LLExecutor()
    bits = lt.allocate_token_bitmask(len(matchers), vocab)
    lt.fill_next_token_bitmask_par(_EXECUTOR, [(m, i) for i, m in enumerate(matchers)], bits)
    words = bits.to(torch.int64) & 0xFFFFFFFF  # int32 words, low bit first
    mask = ((words[:, :, None] >> torch.arange(32)) & 1).bool().flatten(1)[:, :vocab]
    if special is not None:
        for row, col in mask[:, special].nonzero().tolist():  # (usually none or a few)
            if not matchers[row].validate_tokens([int(special[col])]):
                mask[row, special[col]] = False
    return mask


_EXECUTOR = None
