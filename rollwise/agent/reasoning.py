"""A thinking model's reasoning, apart from its reply (vLLM's `--reasoning-parser`): the text between
`<think>` and `</think>` is reasoning, the rest the content, whose tool calls are parsed and whose
answer is scored. `qwen3`: a reply that opens with `<think>` reasons up to `</think>`; one that does
not (thinking off) is all content. `deepseek_r1`: the chat template opens `<think>` in the prompt
(R1's, and Qwen3's 2507 thinking models'), so a reply reasons from its first token up to
`</think>` (the tag itself may be written again). A reply cut off while reasoning is all
reasoning, no content, streamed or not."""
from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; valid: {REASONING_PARSERS}")
        self.name = name
        self.opens_in_prompt = name == "deepseek_r1"

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole reply; reasoning None when the reply has none."""
        at = self.content_start(text, final=True)
        if at == 0:
            return None, text
        reasoning = text[:at]
        if reasoning.endswith(END):
            reasoning = reasoning[:-len(END)]
        lead = reasoning.lstrip()
        return (lead[len(START):] if lead.startswith(START) else reasoning), text[at:]

    def content_start(self, text: str, final: bool = False) -> int | None:
        """Where the content begins in a reply (so far): after `</think>`, or 0 when the reply does
        not reason; None while it is reasoning (or may yet turn out to be, before `final`)."""
        lead = text.lstrip()
        if not self.opens_in_prompt and not lead.startswith(START):
            # ("", or "<thi": it may yet open a think block)
            return None if not final and START.startswith(lead) else 0
        at = text.find(END)
        if at >= 0:
            return at + len(END)
        return len(text) if final else None

    def shown_reasoning(self, text: str) -> str:
        """Of a reply still reasoning, the reasoning that can be streamed: without the opening tag
        and holding back an end that may be `</think>` being written."""
        lead = text.lstrip()
        body = lead[len(START):] if lead.startswith(START) else "" if START.startswith(lead) else text
        for k in range(min(len(END) - 1, len(body)), 0, -1):
            if END.startswith(body[-k:]):
                return body[:-k]
        return body


REASONING_PARSERS = ["deepseek_r1", "qwen3"]


def make_reasoning_parser(name: str | None) -> ReasoningParser | None:
    return None if name is None else ReasoningParser(name)
