"""Sleep mode (vLLM's `sleep` / `wake_up`, SGLang's release / resume of memory occupation): an idle
engine gives its KV pool, and at level 2 its weights, back to the operating system, so a trainer
that shares the machine with it (colocated RL: verl's hybrid engine) can use that memory while it
trains, and takes them again before it serves.

- level 1, tag "kv_cache": the KV pool (and the routing pool) is freed and every cached prefix
  forgotten; the weights stay. Waking zeroes a fresh pool.
- level 2, tags "kv_cache" and "weights": the weights are freed too (every version but the newest
  dropped, the newest's tensors emptied). Waking takes their memory again, but their values are
  gone: the engine serves nothing until `update_weights` gives it every weight (a RL step's update).

A part of LLMEngine (`SleepMode`), kept apart to keep the loop short."""
from __future__ import annotations

from rollwise.engine import allocator

SLEEP_TAGS = ("weights", "kv_cache")


class EngineAsleep(RuntimeError):
    """A request to an engine whose KV pool or weights are given back (another replica may serve it)."""


def sleep_tags(tags) -> set[str]:
    """The tags named (None: all of them), or ValueError naming the valid ones."""
    tags = set(SLEEP_TAGS if tags is None else [tags] if isinstance(tags, str) else tags)
    if not tags or not tags <= set(SLEEP_TAGS):
        raise ValueError(f"sleep mode's tags are {list(SLEEP_TAGS)} (or none given: both); got {sorted(tags)}")
    return tags


class SleepMode:
    """LLMEngine's sleep mode (state set in LLMEngine.__init__: `asleep`, the tags given back, and
    `weights_missing`, the weights not loaded yet (load_format "dummy") or not again since a level-2
    sleep gave them back: the engine serves nothing until update_weights has brought every one)."""

    def sleep(self, level: int = 1) -> None:
        """vLLM's levels: 1 gives back the KV pool, 2 the KV pool and the weights. The engine must be
        idle (ValueError naming the requests in flight otherwise: finish or abort them first)."""
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"sleep level must be 1 (the KV cache) or 2 (the KV cache and the weights), got {level!r}")
        self.release_memory(["kv_cache"] if level == 1 else SLEEP_TAGS)

    def release_memory(self, tags=None) -> None:
        """Give back the memory of the tags named ("kv_cache", "weights"; None: both)."""
        tags = sleep_tags(tags)
        if self.seqs:
            raise ValueError(f"{len(self.seqs)} request(s) in flight (e.g. {next(iter(self.seqs))!r}); "
                             "an engine sleeps idle: finish or abort them first")
        if "kv_cache" in tags - self.asleep:
            self.blocks.reset()
            self.runner.free_kv()
        if "weights" in tags - self.asleep:
            newest = self._loaded[-1]
            for u in self._loaded[:-1]:  # only the newest's model stays, emptied
                self._roots.pop(u, None)
                self._adapters.pop(u, None)
            self._loaded = [newest]
            self.blocks.evict_cached()  # (with the KV pool kept: nothing it cached is of weights held now)
            self.weights_missing = set(self.runner.model.hf_tensors())
            self.runner.free_weights()
        self.asleep |= tags
        allocator.trim()

    def wake_up(self, tags=None) -> None:
        """Take the memory of the tags named (None: every one asleep) again. Weights woken after a
        level-2 sleep have no values until `update_weights` has loaded every one (at once, or in
        buckets of them, as trainers send them)."""
        tags = sleep_tags(tags) & self.asleep
        if "weights" in tags:
            self.runner.alloc_weights()
        if "kv_cache" in tags:
            self.runner.alloc_kv()
        self.asleep -= tags

    @property
    def weights_lost(self) -> bool:
        """From the start with dummy weights, or a level-2 sleep, until every weight is loaded."""
        return bool(self.weights_missing)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def _check_awake(self) -> None:
        """EngineAsleep unless the engine can serve a request now."""
        if self.asleep:
            raise EngineAsleep(f"the engine is asleep ({', '.join(sorted(self.asleep))} given back): wake it up first "
                               "(POST /wake_up, or /resume_memory_occupation)")
        if self.weights_lost:
            raise EngineAsleep(f"the engine has no weights (load_format 'dummy', or a level-2 sleep gave them back): "
                               f"load every weight (update_weights) before it serves ({len(self.weights_missing)} "
                               f"not loaded yet, e.g. {min(self.weights_missing)!r})")

    def _check_weights_update(self) -> None:
        """EngineAsleep while the weights sleep."""
        if "weights" in self.asleep:
            raise EngineAsleep("the engine's weights are asleep: wake_up(tags=['weights']) before updating them")
