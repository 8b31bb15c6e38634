"""The engine's weights: versions held at once (each request runs under its own; a weight update
starts a new one while requests in flight finish under theirs, or move with partial rollout),
versions that are the held weights plus a LoRA adapter (a LoRA run's updates), and the LoRA
adapters served by name. A part of LLMEngine (`WeightVersions`), kept apart to keep the loop short."""
from __future__ import annotations

from pathlib import Path

import torch

from rollwise.engine.sequence import Sequence, Status
from rollwise.types import WeightVersionSpan
from rollwise.wire import AdapterWeights


class WeightVersions:
    """LLMEngine's weights versions and LoRA adapters (state set in LLMEngine.__init__: `_loaded`,
    `_roots`, `_adapters`, `loras`, `_lora_uids`, `policy_version`, `weight_updates`), and vLLM's
    ways in to them (a weights label, `collective_rpc`, the worker and model a trainer writes through)."""

    weight_label = "default"  # vLLM's weight version: a name the caller gives the weights (set_weight_version)
    _receiver = None  # vLLM 0.32's weight transfer, the engine's side (made when first used)
    _group_receiver = None  # SGLang's weight update from a process group, the same

    # weights -------------------------------------------------------------------------------------
    def update_weights(self, weights, version: int | None = None, partial_rollout: bool = False) -> int:
        """New weights (a state dict or a model directory), checked first (ValueError, nothing
        changes); they serve every request admitted from now on, and those waiting that have not
        sampled a token yet (e.g. held during a pause for the update). Requests in flight finish under
        the weights they started with (both versions run in the same steps, one forward each; the
        old weights are dropped when their last request ends), or with `partial_rollout` they are
        interrupted: their KV is dropped and they continue under the new weights from their tokens
        so far (kept, with their logprobs; recomputed), starting a new version segment. Requests
        pinned to a version stay on it. The last `keep_weight_versions` versions stay held for
        pinned requests. KV cached under other weights is never matched. The version becomes
        `version` (the trainer's count) or the next one. Returns it.

        `weights` may instead be a LoRA adapter (AdapterWeights, or a peft directory): the new version
        is then the newest weights plus that adapter, held without a copy of the weights (a LoRA run's
        update: a few MB of adapter, not the model)."""
        self._check_weights_update()  # (sleep mode: the weights awake)
        adapter = self._policy_adapter(weights)
        if adapter is not None:
            if self.weights_lost:
                raise ValueError("the engine has no weights (load_format 'dummy', or a level-2 sleep): load every "
                                 "weight before an adapter")
            return self._new_version(self.policy_version + 1 if version is None else version, partial_rollout, adapter)
        state = self.runner.prepare_weights(weights)
        v = self.policy_version + 1 if version is None else version
        # a version nothing will need is overwritten in place (the newest if it can be: then nothing
        # is copied twice); with nothing in flight and one version kept, that is every update
        keep = self.config.keep_weight_versions
        used = {s.weights_version for s in self.seqs.values()}
        used |= set(self._loaded[max(0, len(self._loaded) - keep + 1):])  # the newest keep - 1 stay beside v
        free = [u for u in self._loaded if u not in used and not self.runner.shared(u)] if v not in self._roots else []
        reuse = (self._loaded[-1] if self._loaded[-1] in free else free[0]) if free else None
        if self.weights_lost:  # (the emptied model takes them, a bucket at a time: the version it held has no
            reuse = self._loaded[-1]  # values; it serves again once every weight is in)
            self.weights_missing -= set(state)
        self.runner.add_weights(v, state, reuse)
        if reuse is not None:  # its weights are overwritten: what it cached is never matched again
            self.blocks.evict_cached({reuse})
        self._roots.pop(reuse, None)
        self._adapters.pop(reuse, None)
        self._loaded = [u for u in self._loaded if u != reuse]
        return self._new_version(v, partial_rollout)

    def check_update(self, shapes: dict[str, list[int]]) -> None:
        """What `update_weights` would refuse of weights of these names and shapes, before they come
        (ValueError, or EngineAsleep while the weights sleep): a trainer's handshake asks it."""
        self._check_weights_update()
        self.runner.prepare_weights({n: torch.empty(s, device="meta") for n, s in shapes.items()})

    def load_weights(self, weights) -> set[str]:
        """vLLM's `model.load_weights`: (name, tensor) pairs under Hugging Face's names (or a dict),
        written into the newest weights in place, checked first (ValueError, nothing changes).
        Requests in flight read them from their next step, as under vLLM; what was cached under the
        weights before is never matched again (vLLM keeps it until `reset_prefix_cache`). Only the
        linears written are packed again, so a trainer may send one tensor a call. Returns the names."""
        state = dict(weights.items() if isinstance(weights, dict) else weights)
        if self._adapters.get(self.policy_version) is not None:
            raise ValueError("the newest weights are the held ones plus a LoRA adapter (a LoRA run's update): "
                             "send a full update with update_weights instead")
        self.update_weights(state, version=self.policy_version)
        return set(state)

    # vLLM's weights label and worker -------------------------------------------------------------
    def set_weight_version(self, label: str) -> None:
        """vLLM's: name the weights `label`; tokens sampled from now on are counted under it
        (RequestOutput.weight_versions). Requests live now start a new span."""
        if not isinstance(label, str) or not label:
            raise ValueError(f"a weight version is a non-empty string, got {label!r}")
        for seq in self.seqs.values():
            seq.label_starts = (seq.label_starts or [(self.weight_label, 0)]) + [(label, seq.num_output_tokens)]
        self.weight_label = label

    def get_weight_version(self) -> str:
        return self.weight_label

    def weight_spans(self, seq: Sequence) -> list[WeightVersionSpan]:
        """vLLM's weight_versions of a sequence's output: [start, end) under each label, in order."""
        spans: list[list] = []
        for label, start in seq.label_starts or [(self.weight_label, 0)]:
            if spans and spans[-1][1] == start:  # (relabelled before it sampled another token)
                spans.pop()
            if not spans or spans[-1][0] != label:
                spans.append([label, start])
        ends = [s[1] for s in spans[1:]] + [seq.num_output_tokens]
        return [WeightVersionSpan(label, start, end) for (label, start), end in zip(spans, ends)]

    @property
    def model_executor(self):
        """vLLM's: `model_executor.driver_worker` is the worker (its `.worker` too), as RL code reaches
        the model: `llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(...)`."""
        return self.worker.executor

    @property
    def receiver(self):
        """vLLM 0.32's weight transfer, this engine's side (rollwise.engine.weight_transfer: the gloo
        backend). Its receiving runs on the caller's thread; `finish_weight_update` takes what came."""
        if self._receiver is None:
            from rollwise.engine.weight_transfer import GlooReceiver
            self._receiver = GlooReceiver(self.check_update)
        return self._receiver

    @property
    def group_receiver(self):
        """SGLang's weight update from a process group, this engine's side (rollwise.engine.group_transfer)."""
        if self._group_receiver is None:
            from rollwise.engine.group_transfer import GroupReceiver
            self._group_receiver = GroupReceiver(self.check_update)
        return self._group_receiver

    def finish_weight_update(self, weight_version: str | None = None, partial_rollout: bool = False) -> int:
        """vLLM 0.32's: the weights received since start_weight_update, as one update (a new version;
        none if nothing came), then named `weight_version` if given. Returns the policy version."""
        staged = self.receiver.finish()
        v = self.update_weights(staged, partial_rollout=partial_rollout) if staged else self.policy_version
        if weight_version is not None:
            self.set_weight_version(weight_version)
        return v

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
                       ) -> list:
        """vLLM's: run a worker method (its name, or a function taking the worker first) on every
        worker, here the one: [its result]. (In process, between steps; `timeout` is not enforced,
        as vLLM's single-process executor does not.)"""
        return [self.worker.execute_method(method, *args, **(kwargs or {}))]

    def apply_model(self, func) -> list:
        """vLLM's: [func(model)] for each worker's model (here one; loading goes through load_weights)."""
        return self.collective_rpc("apply_model", args=(func,))

    def _new_version(self, v: int, partial_rollout: bool, adapter=None) -> int:
        """Version v (its weights in the runner, or with `adapter` the newest weights plus it) becomes the newest."""
        if adapter is not None:
            self.runner.alias(v)
            self._adapters[v] = adapter
        else:
            self._adapters.pop(v, None)
        # KV cached under weights no request will run on again is forgotten now (its blocks are reused
        # first, and the pool's memory stays its working set's): with one version kept, every older
        # version's; otherwise a version's when it is dropped or its number comes again
        if self.config.keep_weight_versions == 1:
            self.blocks.evict_cached()
        elif v in self._roots:
            self.blocks.evict_cached({v})
        self.weight_updates += 1
        self._roots[v] = self.weight_updates  # salt: KV of earlier weights never matches
        self._loaded = [u for u in self._loaded if u != v] + [v]
        self.policy_version = v
        moving = lambda seq: not seq.pinned and seq.weights_version != v  # noqa: E731
        if partial_rollout:
            self.stats["num_interrupted"] += self.scheduler.requeue_running(moving)
        for seq in self.seqs.values():  # (one that has not begun, e.g. held during a pause, begins under v)
            if moving(seq) and (partial_rollout or seq.status is Status.WAITING and not seq.num_output_tokens):
                self._switch(seq, v)
        self._drop_unused()
        return v

    def _policy_adapter(self, weights):
        """The adapter when `weights` are a LoRA adapter on the held weights (AdapterWeights, or a peft
        directory), built and checked; None for weights."""
        from rollwise.engine import lora
        if isinstance(weights, AdapterWeights):
            config, state = weights.config, weights.tensors
        elif isinstance(weights, (str, Path)) and _is_file(Path(weights) / "adapter_config.json"):
            config, state = lora.read_adapter(weights)
        else:
            return None
        if not self.config.enable_lora:
            raise ValueError("weights as a LoRA adapter need an engine started with enable_lora (--enable-lora)")
        return lora.build(self.runner.model, "policy", config, state, next(self._lora_uids), self.config.max_lora_rank)

    def _switch(self, seq: Sequence, v: int) -> None:
        """Move a sequence without KV onto version v's weights: its next tokens are v's."""
        n = seq.num_output_tokens
        if n == 0:  # nothing sampled yet: all of it runs under the new weights
            seq.policy_version, seq.version_segments = v, []
        else:
            seq.version_segments = (seq.version_segments or [(0, seq.weights_version)]) + [(n, v)]
        if seq.params.lora is None:
            seq.adapter = self._adapters.get(v)
        seq.weights_version, seq.hash_root = v, self._root(seq, v)
        seq.block_hashes.clear()

    def _root(self, seq: Sequence, v: int) -> int:
        """The salt of a sequence's KV block hashes: its weights version's, its adapter's (KV differs by
        both) and its cache_salt's (KV is shared only within a salt; str hashes are keyed per process)."""
        if seq.adapter is None and seq.cache_salt is None:
            return self._roots[v]
        adapter = seq.adapter.uid if seq.adapter is not None else None
        return hash((self._roots[v], adapter, seq.cache_salt)) & (2**63 - 1)

    # LoRA adapters -------------------------------------------------------------------------------
    def add_lora(self, name: str, adapter) -> None:
        """Serve a LoRA adapter (peft's directory, or its (config, tensors)) as `name`; one loaded
        again replaces it for requests admitted from now on. ValueError for one that cannot be served."""
        from rollwise.engine import lora
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need an engine started with enable_lora (--enable-lora)")
        if not isinstance(name, str) or not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        if name not in self.loras and len(self.loras) >= self.config.max_loras:
            raise ValueError(f"{len(self.loras)} LoRA adapters are loaded, max_loras is {self.config.max_loras}; "
                             "unload one first")
        config, state = lora.read_adapter(adapter) if isinstance(adapter, (str, Path)) else adapter
        self.loras[name] = lora.build(self.runner.model, name, config, state, next(self._lora_uids),
                                      self.config.max_lora_rank)

    def remove_lora(self, name: str) -> None:
        """Stop serving an adapter (requests already running on it finish with it)."""
        if self.loras.pop(name, None) is None:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.loras)}")

    def _drop_unused(self) -> None:
        """Drop weight versions no request runs on, beyond the newest `keep_weight_versions`."""
        if len(self._loaded) <= self.config.keep_weight_versions:
            return
        used = {s.weights_version for s in self.seqs.values()}
        keep = set(self._loaded[-self.config.keep_weight_versions:]) | used
        dropped = [u for u in self._loaded if u not in keep]
        for u in dropped:
            self.runner.drop_weights(u)
            self._loaded.remove(u)
            del self._roots[u]
            self._adapters.pop(u, None)
        if dropped:  # (called as requests end: walk the cached blocks only when a version went)
            self.blocks.evict_cached(set(dropped))


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError as e:  # (a name too long, say: is_file raises where the path cannot be looked at)
        raise ValueError(f"cannot read {path}: {e}") from e
