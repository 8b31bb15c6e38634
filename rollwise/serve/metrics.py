"""Prometheus text exposition of the engine's metrics dict, under vLLM's metric names where one exists."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from rollwise.engine.request_stats import HELP

# (our key, exposed name, type, help)
METRICS = [
    ("num_running", "vllm:num_requests_running", "gauge", "Requests in the running batch"),
    ("num_waiting", "vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled"),
    ("kv_usage", "vllm:kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0-1)"),
    ("prefix_queries", "vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache"),
    ("prefix_hits", "vllm:prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache"),
    ("prompt_tokens", "vllm:prompt_tokens_total", "counter", "Prompt tokens received"),
    ("generated_tokens", "vllm:generation_tokens_total", "counter", "Tokens generated"),
    ("num_preemptions", "vllm:num_preemptions_total", "counter", "Sequences preempted (recomputed later)"),
    ("num_finished", "vllm:request_success_total", "counter", "Requests finished"),
    ("prefill_tokens", "rollwise:prefill_tokens_computed_total", "counter", "Prompt tokens whose KV was computed"),
    ("decode_tokens", "rollwise:decode_tokens_computed_total", "counter", "Decode tokens computed"),
    ("num_steps", "rollwise:engine_steps_total", "counter", "Engine steps run"),
    ("step_time_s", "rollwise:engine_step_seconds_total", "counter", "Time spent in engine steps"),
    ("num_evictions", "rollwise:prefix_cache_evictions_total", "counter", "Cached blocks evicted"),
    ("num_kv_blocks", "rollwise:num_kv_blocks", "gauge", "KV blocks in the pool"),
    ("kv_capacity_tokens", "rollwise:kv_capacity_tokens", "gauge", "Tokens the KV pool holds"),
    ("policy_version", "rollwise:policy_version", "gauge", "Weights version of requests admitted now"),
    ("is_sleeping", "rollwise:is_sleeping", "gauge", "1 while the KV pool or weights are given back (sleep mode)"),
    ("weights_pending", "rollwise:weights_pending", "gauge", "1 while new weights wait for requests in flight to finish"),
    ("num_interrupted", "rollwise:interrupted_requests_total", "counter",
     "Requests interrupted by a weight update (partial rollout) and continued under the new weights"),
    ("num_failed_steps", "rollwise:failed_engine_steps_total", "counter",
     "Engine steps that raised (each failed only the request that caused it)"),
    ("spec_verifications", "vllm:spec_decode_num_drafts_total", "counter", "Drafts verified"),
    ("spec_drafted_tokens", "vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified"),
    ("spec_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted"),
    ("spec_steps", "rollwise:spec_steps_total", "counter", "Steps that verified drafts"),
]


def prometheus_text(values: dict[str, float], model_name: str, histograms: dict | None = None) -> str:
    """The engine's metrics dict, and its request histograms (`RequestStats.snapshot()`: name ->
    (bounds, cumulative counts, sum, count)) under vLLM's names, written by prometheus_client."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape(values, model_name, histograms or {}))
    return generate_latest(registry).decode()


class _Scrape:
    """One scrape's values, as prometheus_client's custom collectors give them."""

    def __init__(self, values: dict[str, float], model_name: str, histograms: dict) -> None:
        self.values, self.model, self.histograms = values, model_name, histograms

    def collect(self):
        for key, name, kind, help_ in METRICS:
            if key in self.values:
                family_of = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = family_of(name, help_, labels=["model_name"])
                family.add_metric([self.model], float(self.values[key]))
                yield family
        for key, (bounds, cumulative, total, count) in self.histograms.items():
            family = HistogramMetricFamily(f"vllm:{key}", HELP[key], labels=["model_name"])
            buckets = [(str(float(b)), c) for b, c in zip(bounds, cumulative)] + [("+Inf", count)]
            family.add_metric([self.model], buckets, sum_value=total)
            yield family


def router_text(values: dict[str, float]) -> str:
    """A router's metrics dict as gauges `rollwise_router:NAME`; a key "NAME/REPLICA" is NAME's sample
    for that replica (label `replica`)."""
    by_name: dict[str, dict[str | None, float]] = {}
    for key, v in values.items():
        name, _, replica = key.partition("/")
        by_name.setdefault(name, {})[replica or None] = float(v)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Router(by_name))
    return generate_latest(registry).decode()


class _Router:
    def __init__(self, by_name: dict[str, dict[str | None, float]]) -> None:
        self.by_name = by_name

    def collect(self):
        for name, samples in self.by_name.items():
            family = GaugeMetricFamily(f"rollwise_router:{name}", f"the router's {name}", labels=["replica"])
            for replica, v in samples.items():
                family.add_metric([replica] if replica else [], v)
            yield family
