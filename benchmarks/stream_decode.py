"""What decoding a streamed reply costs the server, two ways: the whole output decoded again at
every chunk (the baseline: what the server did before) and each chunk's new tokens only
(`Tokenizer.decoder`, tokenizers' DecodeStream: what it does now). The server's event loop does
this work for every stream it serves, between every other request's chunks.

1. A completion streamed by `rollwise serve` over HTTP (its chunks' token ids kept): both ways
   must give the streamed text; its seconds per token put the decoding in proportion.
2. Agent text (the tau-bench trajectories' messages, tokenized by the model's tokenizer) streamed
   a token a chunk, as a decode without speculation sends it, at several lengths: decode seconds
   each way and their ratio. (A random model's tokens decode faster than text: the stream of part 1
   shows that too, so part 2 takes the work from real text.) Beside it, the engine thread's output
   for the same stream each step: a copy of the whole output so far (before) against the step's
   new token only (now), its lists growing as a request's do.
3. The chat stream's text work on the same agent text, a thinking model's (`<think>` its first half
   `</think>` its second), served with a reasoning parser (qwen3) and a tool-call parser (hermes):
   the real `stream_chat` (the server's code, fed the tokens by a replay of the engine's side) against
   what it did before, each chunk the whole-text methods on the reply so far (`content_start`,
   `shown_reasoning`, `split`, `content_end`) and the whole text re-cut for stop strings. Both
   decode the tokens the same way; both must give the same reasoning and content.

    python benchmarks/stream_decode.py [--smoke] [--tokens 1000] [--lengths 2000,8000,32000] [--model DIR]
        [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from rollwise.agent.parsing import HermesParser, openai_tool_calls
from rollwise.agent.reasoning import ReasoningParser
from rollwise.engine.tokenizer import Tokenizer
from rollwise.serve.process import ServerProcess
from rollwise.serve.responses import stream_chat
from rollwise.types import RequestOutput, SamplingParams

from common import engine_model, write_json  # (benchmarks/common.py)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "agent-trajectories" / "public.jsonl"


def agent_text(tok: Tokenizer, tokens: int) -> list[int]:
    """The trajectories' messages, in order, tokenized: at least `tokens` ids."""
    ids: list[int] = []
    with open(DATA) as f:
        for line in f:
            for m in json.loads(line)["turns"]:
                ids += tok.encode(str(m.get("content") or ""), add_special_tokens=False)
            if len(ids) >= tokens:
                return ids[:tokens]
    raise SystemExit(f"{DATA} holds fewer than {tokens} tokens")


def stream(url: str, tokens: int) -> tuple[list[list[int]], str, float]:
    """One streamed completion: each chunk's new token ids, the text, and the stream's seconds."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "seed": 0,
            "stream": True, "return_token_ids": True}
    chunks, text, t0 = [], "", time.perf_counter()
    with httpx.Client(timeout=None) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                chunks.append(choice.get("token_ids") or [])
                text += choice["text"]
                if len(chunks) % 200 == 0:
                    print(f"\r  streamed {sum(map(len, chunks))}/{tokens} tokens", end="", file=sys.stderr)
    print(file=sys.stderr)
    return chunks, text, time.perf_counter() - t0


def replay(tok: Tokenizer, chunks: list[list[int]]) -> dict:
    """The decoding of the stream's chunks both ways: seconds and final text of each."""
    ids: list[int] = []
    t0 = time.perf_counter()
    for c in chunks:  # the baseline: the whole output so far, decoded at every chunk
        ids += c
        whole = tok.decode(ids)
    whole_s = time.perf_counter() - t0
    grow, steps = tok.decoder(), ""
    t0 = time.perf_counter()
    for c in chunks:
        steps += grow(c)
    steps_s = time.perf_counter() - t0
    return {"whole_s": whole_s, "steps_s": steps_s, "whole_text": whole, "steps_text": steps}


def engine_outputs(ids: list[int], prompt: int = 2000) -> tuple[float, float]:
    """The engine thread's per-step output for a streaming request over `ids`, a token a step:
    seconds copying the whole output each step (ids, logprobs, top logprobs; before) and taking the
    step's new token only (`LLMEngine._progress`; now), the request's lists growing as they do."""
    seconds = []
    for whole in (True, False):
        token_ids, logprobs, tops = list(range(prompt)), [], []
        t0 = time.perf_counter()
        for t in ids:
            token_ids.append(t)
            logprobs.append(-1.0)
            tops.append({})
            n = len(logprobs)
            if whole:
                out = (token_ids[prompt:], list(logprobs), list(tops))
            else:
                out = (token_ids[prompt + n - 1:], logprobs[n - 1:n], tops[n - 1:n])
        seconds.append(time.perf_counter() - t0)
        assert len(out[0]) == (len(ids) if whole else 1)
    return seconds[0], seconds[1]


class _Replay:
    """The engine's side of a stream, replayed: the output grown in place a token a step, then the
    final one (the model's time is not what is measured here)."""

    def __init__(self, tok: Tokenizer, ids: list[int]) -> None:
        self.tokenizer, self.ids = tok, ids

    async def stream(self, prompt, params, rid, group_id=None, **options):
        out = RequestOutput(request_id=rid, prompt_token_ids=prompt)
        for t in self.ids:
            out.token_ids.append(t)
            out.logprobs.append(0.0)
            out.top_logprobs.append({})
            yield out
        yield RequestOutput(request_id=rid, prompt_token_ids=prompt, token_ids=list(self.ids),
                            text=self.tokenizer.decode(self.ids), finished=True,
                            finish_reason="length")


async def chat_before(engine: _Replay, reasoning: ReasoningParser, tools: HermesParser):
    """The chat stream's chunks as the server built them before (a step's new tokens decoded alone, as
    now): each chunk cut the whole text so far for stop strings and ran the whole-text methods on it."""
    grow, grown, sent_text, whole, thought, sent, n = engine.tokenizer.decoder(), "", "", "", 0, 0, 0
    async for out in engine.stream([1], None, "r"):
        final = out.finished
        if final:
            text = out.text
        else:
            text = grown = grown + grow(out.token_ids[n:])  # (no stop string: nothing held back)
        n, delta = len(out.token_ids), text[len(sent_text):] if text.startswith(sent_text) else ""
        sent_text, d = text, {}
        whole = text if final else whole + delta
        at = reasoning.content_start(whole, final=final)
        said = reasoning.shown_reasoning(whole) if at is None else reasoning.split(whole[:at])[0] or ""
        if len(said) > thought:
            d = {"reasoning_content": said[thought:], "reasoning": said[thought:]}
            thought = len(said)
        text = "" if at is None else whole[at:]
        calls = openai_tool_calls(text, tools) if final else None
        if calls is not None:  # (the text outside the calls that was not shown; the calls left out here)
            rest = tools.content(text)[sent:]
            d.update(content=rest if rest.strip() else None)
        else:
            shown = tools.content_end(text) if not final else len(text)
            if shown > sent or not d:
                d["content"] = text[sent:max(shown, sent)]
            sent = max(shown, sent)
        yield {"id": "r", "object": "chat.completion.chunk", "created": int(time.time()), "model": "m",
               "choices": [{"index": 0, "delta": d, "finish_reason": None, "logprobs": None}]}


def chat_now(engine: _Replay, reasoning: ReasoningParser, tools: HermesParser):
    """The server's `stream_chat`."""
    return stream_chat(engine, [1], SamplingParams(max_tokens=len(engine.ids)), "r", 0, "m", False, None,
                       tools=tools, reasoning=reasoning)


async def _collect(chunks) -> tuple[str, str]:
    said, content = "", ""
    async for chunk in chunks:
        d = chunk["choices"][0]["delta"]
        said, content = said + (d.get("reasoning_content") or ""), content + (d.get("content") or "")
    return said, content


def chat_text(tok: Tokenizer, length: int) -> dict:
    half = agent_text(tok, length)
    ids = tok.encode("<think>", add_special_tokens=False) + half[:length // 2] + \
        tok.encode("</think>", add_special_tokens=False) + half[length // 2:]
    reasoning, tools, out = ReasoningParser("qwen3"), HermesParser(), {}
    for name, chunks in (("before", chat_before), ("now", chat_now)):
        t0 = time.perf_counter()
        out[name] = asyncio.run(_collect(chunks(_Replay(tok, ids), reasoning, tools)))
        out[f"{name}_s"] = time.perf_counter() - t0
    assert out["before"] == out["now"] and out["now"][0] and out["now"][1], "the two ways differ"
    return {"tokens": len(ids), "before_s": out["before_s"], "now_s": out["now_s"],
            "ratio": out["before_s"] / out["now_s"], "reasoning_chars": len(out["now"][0]),
            "content_chars": len(out["now"][1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the 2-layer model, short replies")
    ap.add_argument("--tokens", type=int, default=1000, help="the served reply's length")
    ap.add_argument("--lengths", default="2000,8000,32000", help="the agent-text streams' lengths")
    ap.add_argument("--model", help="a model directory (default: the engine benchmarks' model, made once)")
    ap.add_argument("--json")
    args = ap.parse_args()
    tokens = 200 if args.smoke else args.tokens
    lengths = [500] if args.smoke else [int(x) for x in args.lengths.split(",")]
    model = engine_model("smoke" if args.smoke else "bench", args.model)
    tok = Tokenizer(model)
    with ServerProcess(model, "--max-model-len", str(tokens + 64)) as s:
        chunks, text, stream_s = stream(s.url, tokens)
    n = sum(map(len, chunks))
    r = replay(tok, chunks)
    assert r["whole_text"] == r["steps_text"] == text, "the two decodings differ from the streamed text"
    res = {"served": {"tokens": n, "chunks": len(chunks), "stream_s": stream_s, "whole_decode_s": r["whole_s"],
                      "step_decode_s": r["steps_s"], "ratio": r["whole_s"] / r["steps_s"]},
           "agent_text": {}, "settings": {"tokens": tokens, "model": "smoke" if args.smoke else "bench"}}
    print(f"served: {n} tokens in {len(chunks)} chunks, {stream_s / n * 1e3:.1f} ms a token; decoding the whole "
          f"output at every chunk took {r['whole_s']:.2f} s, each chunk's new tokens {r['steps_s']:.3f} s "
          f"({res['served']['ratio']:.0f}x), the same text")
    for length in lengths:
        ids = agent_text(tok, length)
        r = replay(tok, [[t] for t in ids])
        assert r["whole_text"] == r["steps_text"], "the two decodings differ"
        copy_s, step_s = engine_outputs(ids)
        res["agent_text"][length] = {"tokens": length, "whole_decode_s": r["whole_s"], "step_decode_s": r["steps_s"],
                                     "ratio": r["whole_s"] / r["steps_s"],
                                     "whole_ms_per_token": r["whole_s"] / length * 1e3,
                                     "engine_copy_s": copy_s, "engine_step_s": step_s, "engine_ratio": copy_s / step_s}
        print(f"agent text, {length} tokens a token a chunk: whole output every chunk {r['whole_s']:.2f} s "
              f"({r['whole_s'] / length * 1e3:.2f} ms a token), new tokens only {r['steps_s']:.3f} s "
              f"({r['whole_s'] / r['steps_s']:.0f}x less); the engine's outputs: a copy each step "
              f"{copy_s:.2f} s, the new token only {step_s:.3f} s ({copy_s / step_s:.0f}x less)")
    res["chat_text"] = {}
    for length in lengths:
        r = res["chat_text"][length] = chat_text(tok, length)
        print(f"chat stream's text, {r['tokens']} tokens (reasoning, then content) a token a chunk: before "
              f"{r['before_s']:.2f} s ({r['before_s'] / r['tokens'] * 1e3:.3f} ms a token), now {r['now_s']:.2f} s "
              f"({r['now_s'] / r['tokens'] * 1e3:.3f} ms a token, chunks built too): {r['ratio']:.1f}x, the same text")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
