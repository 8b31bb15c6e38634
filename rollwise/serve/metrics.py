"""Prometheus text exposition of the engine's metrics dict, under vLLM's metric names where one exists."""
from __future__ import annotations

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


def prometheus_text(values: dict[str, float], model_name: str) -> str:
    label = f'{{model_name="{model_name}"}}'
    lines = []
    for key, name, kind, help_ in METRICS:
        if key not in values:
            continue
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{label} {float(values[key])}"]
    return "\n".join(lines) + "\n"
