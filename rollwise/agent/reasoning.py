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


class ReasoningStream:
    """A reply's reasoning as it streams, each piece's work bounded by the piece rather than the reply
    so far (the whole-text methods scan it all: quadratic over a long stream). `feed` the reply so far
    (it only grows) after each piece: the reasoning not yet shown, and where the content starts (None
    while reasoning). The same as `content_start`, `shown_reasoning` and `split` on the whole reply."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.body: int | None = None  # where the reasoning begins (past an opening tag), once known
        self.at: int | None = None  # where the content begins, once known
        self.shown = 0  # reasoning characters given out
        self.searched = 0  # the reply up to here holds no `</think>` starting before its last len(END) - 1

    def feed(self, text: str, final: bool = False) -> tuple[str, int | None]:
        if self.at is not None:
            return "", self.at
        if self.body is None:  # does the reply reason, and from where? (a few characters decide it)
            lead = text.lstrip()
            if lead.startswith(START):
                self.body = len(text) - len(lead) + len(START)
            elif START.startswith(lead) and not final:
                return "", None  # ("", or "<thi": it may yet open a think block)
            elif not self.parser.opens_in_prompt:
                self.at = 0
                return "", 0
            else:
                self.body = 0
        found = text.find(END, max(self.searched - len(END) + 1, 0))
        self.searched = len(text)
        if found >= 0 or final:
            end = found if found >= 0 else len(text)
            self.at = end + len(END) if found >= 0 else end
        else:  # hold back an end that may be `</think>` being written
            end = len(text) - next((k for k in range(min(len(END) - 1, len(text) - self.body), 0, -1)
                                    if END.startswith(text[len(text) - k:])), 0)
        new = text[self.body + self.shown:end]
        self.shown += len(new)
        return new, self.at


REASONING_PARSERS = ["deepseek_r1", "qwen3"]


def make_reasoning_parser(name: str | None) -> ReasoningParser | None:
    return None if name is None else ReasoningParser(name)
