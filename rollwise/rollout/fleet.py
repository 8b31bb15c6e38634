"""The rollout fleet of a training run: N in-process engines (or `rollwise serve` replicas) behind
the router, the CPU cores split between them and the trainer, and their summed counters."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rollwise.router.broadcast import FleetBroadcast
from rollwise.router.replica import HttpReplica, LocalReplica
from rollwise.router.router import Router

if TYPE_CHECKING:
    from rollwise.rl_config import TrainConfig


def threads(cfg: TrainConfig) -> tuple[int, int]:
    """(threads per in-process replica, trainer threads): as configured, else the cores this process
    may use split between the replicas and the trainer, at least one each. A trainer that never runs
    beside the rollouts (synchronous, whole batches) or beside no replica of this process (HTTP
    replicas) gets every core."""
    n, have = 0 if cfg.replica_urls else cfg.replicas, cores()
    per = cfg.replica_threads or max(1, have // (n + 1))
    alone = n == 0 or (cfg.max_staleness == 0 and not cfg.streamed)
    return per, cfg.trainer_threads or (have if alone else max(1, have - n * per))


def cores() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def make_router(cfg: TrainConfig, tokenizer):
    if cfg.replica_urls:
        key = cfg.replica_api_key or os.environ.get("ROLLWISE_API_KEY")
        via = "auto" if cfg.replica_weights_via == "broadcast" else cfg.replica_weights_via  # (when the group fails)
        replicas = [HttpReplica(u, key, weights_via=via) for u in cfg.replica_urls]
    else:
        from rollwise.engine.async_engine import AsyncEngine
        replicas = [LocalReplica(f"replica{i}", AsyncEngine(
            cfg.model, max_num_seqs=cfg.max_num_seqs, kv_cache_gb=cfg.replica_kv_cache_gb, seed=cfg.seed + i,
            speculative=cfg.speculative, spec_controller=cfg.spec_controller, keep_weight_versions=cfg.weight_versions,
            num_threads=threads(cfg)[0], dtype=cfg.replica_dtype, batch_invariant=cfg.replica_batch_invariant,
            enable_return_routed_experts=cfg.routing_replay != "off",
            enable_lora=cfg.lora_sync == "adapter", max_lora_rank=max(cfg.lora_rank, 1)))
            for i in range(cfg.replicas)]
    router = Router(replicas, cfg.routing_policy, tokenizer=tokenizer, max_inflight_per_replica=cfg.max_num_seqs)
    if cfg.replica_urls and cfg.replica_weights_via == "broadcast":
        router.broadcast = FleetBroadcast(key)
    return router


def shutdown(router) -> None:
    for r in router.replicas.values():
        eng = getattr(r, "engine", None)
        if eng is not None:
            eng.shutdown()


def fleet_metrics(router) -> dict:
    """Summed engine counters of in-process replicas (HTTP ones report on their own /metrics); with
    replica_weights_via = "broadcast", the updates the group took and those it failed (each replica's own way)."""
    sent = {} if router.broadcast is None else {f"broadcast_{k}": v for k, v in router.broadcast.stats.items()}
    tot: dict[str, float] = {}
    for r in router.replicas.values():
        eng = getattr(r, "engine", None)
        if eng is None:
            continue
        for k, v in eng.metrics().items():
            tot[k] = tot.get(k, 0.0) + v
    if not tot:
        return sent
    return sent | {
        "generated_tokens": tot.get("generated_tokens", 0.0), "spec_drafted": tot.get("spec_drafted_tokens", 0.0),
        "spec_accepted": tot.get("spec_accepted_tokens", 0.0), "spec_steps": tot.get("spec_steps", 0.0),
        "engine_steps": tot.get("num_steps", 0.0),
        "prefix_hit_rate": tot.get("prefix_hits", 0.0) / max(tot.get("prefix_queries", 0.0), 1.0)}
