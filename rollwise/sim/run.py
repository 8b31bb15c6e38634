"""Run a workload on simulated replicas behind the real `Router` (real policies, real speculation
controllers, real suffix caches), on the virtual clock, and report what a real run would: step
makespan, throughput, prefill and decode tokens computed, acceptance, truncations.

Configurations compared (WAR's ablation, plus ours):
  baseline    verl's router, no speculation
  spec_only   verl's router, threshold speculation (full drafts while <= war_threshold run)
  sched_only  WAR's scheduler (`war` policy), no speculation
  war         WAR: threshold speculation + `war` policy
  rollwise    adaptive speculation controller + `rollwise` policy
"""
from __future__ import annotations

import dataclasses
import gc
import time
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rollwise.config import check_field_types, read_toml
from rollwise.router.router import Router
from rollwise.router.workload import run_step
from rollwise.sim.clock import run as run_virtual
from rollwise.sim.cost import load_profile
from rollwise.sim.replica import SimReplica
from rollwise.sim.workload import SimTrajectory

CONFIGS = {"baseline": ("verl", "off"), "spec_only": ("verl", "threshold"), "sched_only": ("war", "off"),
           "war": ("war", "threshold"), "rollwise": ("rollwise", "adaptive")}
WORKLOADS = ("war", "mooncake")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    profile: str = "h100-qwen3-32b-tp4"  # a file in rollwise/sim/profiles or a TOML path
    replicas: int = 4
    configs: tuple[str, ...] = tuple(CONFIGS)
    loads: tuple[int, ...] = (4, 8, 16, 32, 64)  # prompts per step (x group_size trajectories)
    group_size: int = 8
    workload: str = "war"
    trace: str | None = None  # mooncake: the trace file
    trace_limit: int = 2000
    context: tuple[int, int] = (2048, 8192)
    turns: tuple[int, int] = (10, 50)
    obs_median: int = 400
    tool_latency: tuple[float, float] = (0.2, 10.0)  # seconds, log-uniform (SWE sandbox commands)
    tool_scale: float = 1.0  # multiplies every drawn tool latency (0: instant tools; same tokens and turns)
    sandbox_ttl_s: float = 1800.0  # a trajectory whose turn waits longer than this loses its sandbox
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_blocks: int | None = None  # per replica; default: the profile's capacity
    max_inflight_per_replica: int = 256
    spec_max_tokens: int = 16
    spec_alpha: float | None = None  # draft length / matched length; None: the controller's own (2 adaptive, else 1)
    war_threshold: int = 32  # WAR speculates while at most this many sequences run on a replica
    share_computing_prefix: bool = True  # False: a sibling computes a prefix beside the one computing it
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [c for c in self.configs if c not in CONFIGS]
        if bad:
            raise ValueError(f"unknown configs {bad}; valid: {list(CONFIGS)}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.replicas < 1 or self.group_size < 1 or not self.loads:
            raise ValueError("replicas and group_size must be >= 1 and loads non-empty")
        if self.tool_scale < 0 or not 0 < self.tool_latency[0] <= self.tool_latency[1]:
            raise ValueError(f"need 0 < tool_latency[0] <= tool_latency[1] and tool_scale >= 0, got "
                             f"{list(self.tool_latency)} and {self.tool_scale}")
        load_profile(self.profile)  # fails early with the valid names

    @classmethod
    def from_toml(cls, path: str | Path, overrides: dict | None = None) -> SimConfig:
        return cls.from_dict({**read_toml(path), **(overrides or {})})

    @classmethod
    def from_toml_text(cls, text: str, overrides: dict | None = None) -> SimConfig:
        return cls.from_dict({**tomllib.loads(text), **(overrides or {})})

    @classmethod
    def from_dict(cls, d: dict) -> SimConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown sim config keys {sorted(unknown)}; valid: {sorted(names)}")
        check_field_types(cls, d, "sim config")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def make_replicas(cfg: SimConfig, spec: str, cost=None, **overrides) -> list[SimReplica]:
    cost = cost or load_profile(cfg.profile)
    kw = dict(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
              num_kv_blocks=cfg.kv_blocks, spec=spec, spec_max_tokens=cfg.spec_max_tokens,
              spec_threshold=cfg.war_threshold, spec_alpha=cfg.spec_alpha,
              share_computing_prefix=cfg.share_computing_prefix)
    kw.update(overrides)
    return [SimReplica(f"sim{i}", cost, **kw) for i in range(cfg.replicas)]


@contextmanager
def _cycle_collector_paused():
    """As timeit does: no cyclic garbage collection during a run. A run makes millions of token
    lists and tuples, freed by reference counting; the collector's passes over them cost 8-10% of
    the scale step and find under a thousand objects in cycles per run (asyncio's), collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(cfg: SimConfig, config: str, trajectories: list[SimTrajectory], *, policy: str | None = None,
             spec: str | None = None, cost=None, share_drafts: bool = True, progress: bool = False,
             **replica_overrides) -> dict:
    """One step of `trajectories` under one configuration (or an explicit policy / spec mode).
    `progress`: a live bar of turns done and simulated seconds (stderr)."""
    pol, sp = CONFIGS[config] if config in CONFIGS else (None, None)
    pol, sp = policy or pol, spec or sp
    if pol is None:
        raise ValueError(f"unknown config {config!r}; valid: {list(CONFIGS)} (or pass policy= and spec=)")
    wall = time.perf_counter()
    replicas = make_replicas(cfg, sp, cost, **replica_overrides)

    async def go():
        from tqdm import tqdm
        bar = tqdm(total=sum(len(t.turns) for t in trajectories), desc=f"  {config}", unit="turn", leave=False,
                   disable=not progress)
        router = Router(replicas, pol, max_inflight_per_replica=cfg.max_inflight_per_replica,
                        queue_timeout_s=1e12, share_drafts=share_drafts)
        try:
            return await run_step(router, trajectories, cfg.sandbox_ttl_s, bar), router.metrics()
        finally:
            bar.close()
            await router.close()
            for r in replicas:
                r.close()
    with _cycle_collector_paused():
        res, rm = run_virtual(go())
    ms = [r.metrics() for r in replicas]
    tot = {k: sum(m[k] for m in ms) for k in ms[0]}
    busy = [m["busy_s"] for m in ms]
    return {**res, "policy": pol, "spec": sp, "prefill_tokens": tot["prefill_tokens"],
            "generated_tokens": tot["generated_tokens"], "decode_tokens_computed": tot["decode_tokens"],
            "tok_s": res["decode_tokens"] / max(res["makespan_s"], 1e-9),
            "hit_rate": tot["prefix_hits"] / max(tot["prefix_queries"], 1), "preemptions": tot["preemptions"],
            "evictions": tot["evictions"], "drafted_tokens": tot["drafted_tokens"],
            "accepted_tokens": tot["accepted_tokens"],
            "acceptance_rate": tot["accepted_tokens"] / max(tot["drafted_tokens"], 1),
            "accepted_per_verification": tot["accepted_tokens"] / max(tot["verifications"], 1),
            "max_busy_s": max(busy), "mean_busy_s": sum(busy) / len(busy), "steps": tot["steps"],
            "decision_us": rm["decision_us"], "moves": int(rm["moves"]), "wall_s": time.perf_counter() - wall}
