"""`deltas`: the per-step pieces of one request's output (new token ids, their logprobs, new text) that
`AsyncLLM`'s and the servers' streams are made of. No torch here: the router's proxy streams with it
too, and a router process never loads torch.
"""
from __future__ import annotations

from contextlib import aclosing

from rollwise.types import SamplingParams


async def deltas(engine, prompt, params: SamplingParams, rid: str, group_id: str | None = None, **options):
    """(new token ids, their logprobs, their top logprobs, new text, final output or None) per engine step."""
    tok = engine.tokenizer
    sent_tokens, sent, held = 0, [], ""  # the text given out (in pieces), and what is held back of the rest
    hold = max(map(len, params.stop), default=1) - 1  # text that may begin a stop string waits for the next
    # a step's new tokens decoded alone (a tokenizer without `decoder`: the whole output each step); each
    # step's work is its own tokens', not the output so far (a long reply streams in linear time)
    grow = tok.decoder(params.skip_special_tokens) if hasattr(tok, "decoder") else None
    grow = grow if params.detokenize else (lambda ids: "")  # (no text at all: vLLM's detokenize=False)
    # (closing this generator closes the stream, which aborts the request)
    async with aclosing(engine.stream(prompt, params, rid, group_id=group_id, **options)) as outs:
        async for out in outs:
            if not out.finished and grow is not None and len(out.token_ids) >= sent_tokens:
                held += grow(out.token_ids[sent_tokens:])
                cut = max(len(held) - hold, 0)
                delta, held = held[:cut], held[cut:]
                sent.append(delta)
            else:  # the final text (cut where a stop string begins), or the whole output decoded again
                text = out.text
                if not out.finished:
                    grow, text = None, tok.decode(out.token_ids, params.skip_special_tokens)
                    if text.endswith("\ufffd"):  # half a multi-byte character: wait
                        continue
                    text = text[:max(len(text) - hold, 0)]
                before = "".join(sent)
                delta, sent = text[len(before):] if text.startswith(before) else "", [text]
            new_ids, new_lps, new_tops = (x[sent_tokens:] for x in (out.token_ids, out.logprobs, out.top_logprobs))
            sent_tokens = len(out.token_ids)
            yield new_ids, new_lps, new_tops, delta, out if out.finished else None
