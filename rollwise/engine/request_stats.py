"""Per-request latencies and sizes as vLLM's Prometheus histograms, so a vLLM dashboard or a load
balancer reading them works against `rollwise serve`: time to first token, end to end, queued,
prefill (admitted to first token), decode (first token to the end), inference (admitted to the
end), time per output token (decode over the tokens after the first), prompt and generated tokens.
vLLM's names and bucket bounds. A request is observed when it ends (finished or aborted; time to
first token when that token comes), and at each step that emits its tokens after the first, the
time since its last (inter_token_latency_seconds: one observation per step, however many tokens
speculation accepted in it, as vLLM counts); the engine's thread writes, /metrics reads a copy."""
from __future__ import annotations

import bisect

TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0, 160.0, 640.0, 2560.0)
PER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0)
REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
           480.0, 960.0, 1920.0, 7680.0)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0  # (the last: past every bound)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # (a bucket's `le` bound counts values equal to it)
        self.sum += value

    def snapshot(self) -> tuple[tuple[float, ...], list[int], float, int]:
        """(bounds, cumulative counts per bound, sum, count)."""
        counts, total = list(self.counts), self.sum
        cumulative, n = [], 0
        for c in counts[:-1]:
            n += c
            cumulative.append(n)
        return self.bounds, cumulative, total, n + counts[-1]


HELP = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
}


class RequestStats:
    def __init__(self, max_model_len: int) -> None:
        bounds = {"time_to_first_token_seconds": TTFT, "inter_token_latency_seconds": PER_TOKEN,
                  "request_time_per_output_token_seconds": PER_TOKEN,
                  "request_prompt_tokens": one_two_five(max_model_len)}
        bounds["request_generation_tokens"] = bounds["request_prompt_tokens"]
        self.h = {name: Histogram(bounds.get(name, REQUEST)) for name in HELP}  # (the other timings: REQUEST)

    def emitted(self, seq, now: float) -> None:
        """A step gave `seq` tokens."""
        if seq.t_first_token < 0:
            seq.t_first_token = now
            self.h["time_to_first_token_seconds"].observe(now - seq.t_arrival)
        else:
            self.h["inter_token_latency_seconds"].observe(now - seq.t_last_token)
        seq.t_last_token = now

    def ended(self, seq, now: float) -> None:
        h, n = self.h, seq.num_output_tokens
        h["e2e_request_latency_seconds"].observe(now - seq.t_arrival)
        h["request_prompt_tokens"].observe(seq.prompt_len)
        h["request_generation_tokens"].observe(n)
        if seq.t_scheduled >= 0:
            h["request_queue_time_seconds"].observe(seq.t_scheduled - seq.t_arrival)
            h["request_inference_time_seconds"].observe(now - seq.t_scheduled)
            if seq.t_first_token >= 0:
                h["request_prefill_time_seconds"].observe(seq.t_first_token - seq.t_scheduled)
        if seq.t_first_token >= 0:
            h["request_decode_time_seconds"].observe(now - seq.t_first_token)
            if n > 1:
                h["request_time_per_output_token_seconds"].observe((now - seq.t_first_token) / (n - 1))

    def snapshot(self) -> dict[str, tuple[tuple[float, ...], list[int], float, int]]:
        return {name: hist.snapshot() for name, hist in self.h.items()}
