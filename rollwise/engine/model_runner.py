"""The one place that runs the model: builds the flat batch, owns the KV cache, returns logits.

It may hold several versions of the weights at once (one model each, sharing the KV pool): each
sequence runs under its own, so requests admitted before a weight update finish under the old
weights while new ones start under the new weights, in the same steps."""
from __future__ import annotations

import copy
import math
import mmap
import time

import torch

from rollwise import mkl
from rollwise.config import EngineConfig
from rollwise.engine import lora, native
from rollwise.engine.attention import MAX_SHORT, VECTOR_HEAD_SIZES, build_metadata
from rollwise.engine.models.linear import Linear, check_invariant, pack, packed_linear
from rollwise.engine.models.llama import CausalLM
from rollwise.engine.models.moe import Experts
from rollwise.engine.models.loader import TORCH_DTYPES, check_weights, load_model, load_state_dict, load_weights
from rollwise.engine.sampler import prompt_logprobs
from rollwise.engine.scheduler import ScheduledSeq

PROMPT_LOGITS_ROWS = 512  # prompt logprobs are computed this many positions at a time


def set_threads(n: int) -> None:
    """torch's intra-op thread count for the calling thread (it is per thread). A thread's first
    torch call resets its count to the last one set anywhere in the process, so that call is made
    first: otherwise the count set here is silently undone."""
    torch.get_num_threads()
    torch.set_num_threads(n)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, max_model_len: int) -> None:
        if cfg.num_threads:
            set_threads(cfg.num_threads)
        mkl.settle()  # (before the rotary table is computed on several threads)
        self.device = torch.device(cfg.device)
        self.logprobs_mode = cfg.logprobs_mode  # (prompt logprobs, as vLLM's under a mode: sampler.prompt_logprobs)
        self.model: CausalLM = load_model(cfg.model, cfg.dtype, cfg.device, max_positions=max_model_len,
                                          dummy=cfg.load_format == "dummy")
        if cfg.batch_invariant:
            _check_batch_invariant(cfg, self.model)
            self.model.set_batch_invariant()
        else:
            self.model.prepack()
        self.versions: dict[int, CausalLM] = {0: self.model}  # weights by policy version; self.model: the newest
        self._spare: list[CausalLM] = []  # dropped versions' models, reused for the next ones
        self._emptied: list = []  # (parameter, shape) given back by a level-2 sleep
        mc = self.model.config
        self.block_size = cfg.block_size
        na = cfg.native_attention  # None: where the kernel's vector path runs (batch invariance: always)
        self.native_attention = (mc.head_dim in VECTOR_HEAD_SIZES or cfg.batch_invariant) if na is None else na
        dtype = TORCH_DTYPES[cfg.dtype]
        bytes_per_block = 2 * mc.num_layers * cfg.block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize
        self.num_blocks = cfg.num_kv_blocks or max(2, int(cfg.kv_cache_gb * 2**30 // bytes_per_block))
        self._kv_shape = (mc.num_layers, self.num_blocks * cfg.block_size, mc.num_kv_heads, mc.head_dim)
        self._kv_dtype, self._routed = dtype, cfg.enable_return_routed_experts
        if cfg.enable_return_routed_experts and not mc.moe_layers:
            raise ValueError(f"enable_return_routed_experts needs a model with experts (qwen3_moe); "
                             f"{cfg.model} is {mc.family} without any")
        # Rollout Routing Replay: each KV slot's experts per layer ([layers, slots, k], -1: none),
        # written by every forward, so cached prefixes carry the routing that made their KV
        self.routing: torch.Tensor | None = None
        self.alloc_kv()
        for m in self.model.moe_layers() if self._routed else ():
            m.record = True

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int], dict[int, list]]:
        """One forward over all scheduled tokens (and draft tokens) per weight version in the batch.
        Returns logits; per batch entry, where its rows start in them: the last token's row for
        a sampling sequence, the last token's row followed by one row per draft token for a
        speculating one; -1 if none; and, for entries that want prompt logprobs, those of the prompt
        tokens this step's positions predict ({entry: [(logprob, top), ...]}, in prompt order)."""
        by_version: dict[int, list[int]] = {}
        for i, s in enumerate(batch):
            by_version.setdefault(s.seq.weights_version, []).append(i)
        if len(by_version) == 1:
            return self._run(self.versions[batch[0].seq.weights_version], batch)
        parts, starts, prompts, offset = [], [-1] * len(batch), {}, 0
        for v, idx in by_version.items():
            logits, st, pl = self._run(self.versions[v], [batch[i] for i in idx])
            for i, s0 in zip(idx, st):
                starts[i] = s0 + offset if s0 >= 0 else -1
            prompts.update({idx[j]: x for j, x in pl.items()})
            parts.append(logits)
            offset += logits.shape[0]
        return torch.cat(parts), starts, prompts

    def _run(self, model: CausalLM, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int], dict[int, list]]:
        ids, positions, rows, starts, q_lens, trees, prompt_rows = [], [], [], [], [], {}, {}
        adapted: dict[object, list[int]] = {}  # LoRA adapter -> its requests' rows
        row = 0
        for b, s in enumerate(batch):
            c, n = s.num_computed_before, s.num_new_tokens
            if s.seq.adapter is not None:
                adapted.setdefault(s.seq.adapter, []).extend(range(row, row + n + (len(s.draft) if s.draft else 0)))
            ids.extend(s.seq.token_ids[c:c + n])
            positions.extend(range(c, c + n))
            if s.seq.needs_prompt_logprobs:  # position p's row predicts prompt token p + 1
                first, end = max(c, len(s.seq.prompt_logprobs) - 1), min(c + n, s.seq.prompt_len - 1)
                if first < end:
                    prompt_rows[b] = (row + first - c, row + end - c, first)
            row += n
            if s.draft is not None and len(s.draft):
                d = s.draft
                depth = draft_depths(d.parents)
                ids.extend(d.token_ids)
                positions.extend(c + n - 1 + x for x in depth)
                if any(p != i - 1 for i, p in enumerate(d.parents)):  # a chain is already causal
                    trees[b] = tree_mask(d.parents, n)
                starts.append(len(rows))
                rows.extend(range(row - 1, row + len(d)))
                row += len(d)
            elif s.samples:
                starts.append(len(rows))
                rows.append(row - 1)
            else:
                starts.append(-1)
            q_lens.append(n + (len(s.draft) if s.draft is not None else 0))
        meta = build_metadata(q_lens, [s.num_computed_before for s in batch], [s.seq.block_table for s in batch],
                              self.block_size, self.device, trees, self.native_attention)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        lora.set_plan([(t(r), a) for a, r in adapted.items()] or None)
        try:
            hidden = model(t(ids), t(positions), meta, self.kv_cache)
        finally:
            lora.set_plan(None)
        if self.routing is not None:
            for i in model.config.moe_layers:
                self.routing[i].index_copy_(0, meta.slot_mapping, model.model.layers[i].mlp.routing.to(torch.int16))
        prompts = {}
        for b, (lo, hi, first) in prompt_rows.items():  # in pieces: a long prompt's logits at once can be GBs
            seq, got = batch[b].seq, []
            for a in range(lo, hi, PROMPT_LOGITS_ROWS):
                z = min(a + PROMPT_LOGITS_ROWS, hi)
                got += prompt_logprobs(model.logits(hidden[a:z]), seq.token_ids[first + 1 + a - lo:first + 1 + z - lo],
                                       seq.params, first + a - lo, seq.prompt_id_scores, self.logprobs_mode)
            prompts[b] = got
        return model.logits(hidden[t(rows)]), starts, prompts

    @torch.inference_mode()
    def time_forward(self, num_tokens: int, repeats: int = 2) -> float:
        """Seconds for a forward of num_tokens tokens (one sequence on scratch blocks; call it only
        while no request holds KV)."""
        bs = self.block_size
        table = list(range(min(self.num_blocks, -(-num_tokens // bs))))
        n = min(num_tokens, len(table) * bs)
        meta = build_metadata([n], [0], [table], bs, self.device, use_native=self.native_attention)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        best = float("inf")
        for _ in range(repeats + 1):  # the first run warms up
            t0 = time.perf_counter()
            self.model.logits(self.model(ids, pos, meta, self.kv_cache)[-1:])
            best = min(best, time.perf_counter() - t0)
        return best

    def release(self) -> None:
        """Drop the KV pool, the routing pool and every weights version (the engine is done)."""
        self.kv_cache, self.routing = (), None
        self.versions.clear()
        self._spare.clear()

    # sleep mode (sleep.py): the KV pool and the weights given back to the OS, and taken again -------
    def alloc_kv(self) -> None:
        """The KV pool (and the routing pool, when kept), zeroed."""
        self.kv_cache = tuple(_zeros(self._kv_shape, self._kv_dtype, self.device) for _ in range(2))
        if self._routed:
            mc = self.model.config
            self.routing = torch.full((mc.num_layers, self._kv_shape[1], mc.experts_per_token), -1,
                                      dtype=torch.int16, device=self.device)

    def free_kv(self) -> None:
        self.kv_cache, self.routing = (), None

    def free_weights(self) -> None:
        """Every version but the newest dropped, the newest's parameters' memory given back (each
        parameter's tensor swapped for an empty one; its shape kept here) and its packed copies
        dropped: until `alloc_weights` and a load of every weight, the model cannot run."""
        self.versions = {v: m for v, m in self.versions.items() if m is self.model}
        self._spare.clear()
        for m in self.model.modules():
            if isinstance(m, (Linear, Experts)):
                m.packed = None
        # (not their storage resized: the native kernels' numpy views pin it. A tied parameter is listed
        # once; a model copied for a weight update holds inference tensors, and gets them back)
        self._emptied = [(p, p.shape, p.is_inference()) for p in self.model.parameters()]
        for p, _, inference in self._emptied:
            with torch.inference_mode(inference):
                p.data = p.data.new_empty(0)

    def alloc_weights(self) -> None:
        """Memory for the newest model's parameters again (its values undefined until loaded)."""
        for p, shape, inference in self._emptied:
            with torch.inference_mode(inference):
                p.data = p.data.new_empty(shape)
        self._emptied = []

    @torch.inference_mode()
    def move_kv(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        """Copy the KV of token positions src to positions dst of one sequence (accepted tree nodes
        into their place on the sequence), in every layer."""
        bs = self.block_size
        slot = lambda p: block_table[p // bs] * bs + p % bs  # noqa: E731
        s = torch.tensor([slot(p) for p in src], device=self.device)
        d = torch.tensor([slot(p) for p in dst], device=self.device)
        for cache in self.kv_cache:
            cache.index_copy_(1, d, cache.index_select(1, s))
        if self.routing is not None:
            self.routing.index_copy_(1, d, self.routing.index_select(1, s))

    def routed_experts(self, block_table: list[int], num_computed: int, num_tokens: int):
        """int32 numpy [num_tokens - 1, layers, k]: the experts of the sequence's first positions, read
        from their KV slots (computed ones; -1 for the rest and in layers without experts)."""
        import numpy as np
        bs = self.block_size
        n = min(num_computed, num_tokens - 1, len(block_table) * bs)
        out = np.full((max(num_tokens - 1, 0), self.routing.shape[0], self.routing.shape[2]), -1, dtype=np.int32)
        if n > 0:
            pos = torch.arange(n)
            slots = torch.tensor(block_table, dtype=torch.long)[pos // bs] * bs + pos % bs
            out[:n] = self.routing[:, slots.to(self.routing.device)].permute(1, 0, 2).cpu().numpy()
        return out

    def prepare_weights(self, weights: dict[str, torch.Tensor] | str) -> dict[str, torch.Tensor]:
        """New weights (tensors under Hugging Face names, or a model directory), read and checked
        against the model without changing it (what `add_weights` takes)."""
        state = load_state_dict(weights) if isinstance(weights, str) else weights
        return check_weights(self.model, state, partial=True)

    @torch.inference_mode()
    def add_weights(self, version: int, state: dict[str, torch.Tensor], reuse: int | None = None) -> None:
        """Hold `state` (checked by `prepare_weights`; a subset updates the newest weights) as
        `version`, now the newest: in place of version `reuse` (one nothing needs any more), else
        in a new copy of the model. A version already held is overwritten in place (unless its model
        is another version's too: then it gets a copy of its own)."""
        model = self.versions.get(version)
        if model is not None and self.shared(version):
            self.versions.pop(version)
            model = None
        assert reuse is None or not self.shared(reuse), "a model another version runs on is not overwritten"
        copied = False
        if model is None:
            model = self.versions.pop(reuse) if reuse is not None else None
            if model is None:
                model = self._spare.pop() if self._spare else _clone(self.model)
            if model is not self.model:
                for dst, src in zip(model.parameters(), self.model.parameters()):
                    dst.copy_(src)
                copied = True
        written = load_weights(model, state, partial=True)
        model.prepack(None if copied else written)  # (in place: only the linears written are packed again)
        self.versions[version] = self.model = model

    def alias(self, version: int) -> None:
        """Hold `version` as the newest weights as they are (a version that differs from them by a
        LoRA adapter alone: no copy)."""
        old = self.versions.get(version)
        self.versions[version] = self.model
        if old is not None and old is not self.model and not any(m is old for m in self.versions.values()):
            self._spare[:] = self._spare or [old]

    def drop_weights(self, version: int) -> None:
        model = self.versions.pop(version)
        assert model is not self.model or any(m is model for m in self.versions.values()), \
            "the newest weights are always held"
        if not self._spare and not any(m is model for m in self.versions.values()):
            self._spare.append(model)  # one kept for the next update made while requests run on old weights

    def shared(self, version: int) -> bool:
        """Whether version's model is another held version's too (`alias`)."""
        m = self.versions.get(version)
        return m is not None and any(u != version and x is m for u, x in self.versions.items())


def _check_batch_invariant(cfg: EngineConfig, model: CausalLM) -> None:
    """ValueError for an engine batch invariance cannot hold in; RuntimeError if this CPU's oneDNN
    gives a row of one of the model's linears other bits among other rows."""
    if cfg.dtype != "float32" or cfg.device != "cpu":
        raise ValueError(f"batch_invariant needs dtype float32 on the CPU (the native attention kernel's); "
                         f"got {cfg.dtype} on {cfg.device}")
    if cfg.native_attention is False or not native.ENABLED:
        raise ValueError("batch_invariant needs the native attention kernel (native_attention not False, "
                         "and the kernels built by pip install)")
    if cfg.spec_tree and cfg.spec_max_tokens >= MAX_SHORT:
        raise ValueError(f"batch_invariant with tree drafts needs spec_max_tokens < {MAX_SHORT} (longer trees "
                         f"run the torch attention); got {cfg.spec_max_tokens}")
    weights = {}  # one of each shape the linears and experts have
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            weights.setdefault((tuple(m.weight.shape), m.weight.dtype), (name, m.weight))
        elif isinstance(m, Experts):
            for kind, w in (("gate_up_proj", m.gate_up_proj[0]), ("down_proj", m.down_proj[0])):
                weights.setdefault((tuple(w.shape), w.dtype), (f"{name}.{kind}", w))
    for name, w in weights.values():
        packed = pack(w)
        if packed is None:
            raise RuntimeError("batch_invariant needs torch with oneDNN (torch.backends.mkldnn)")
        if not check_invariant(lambda x: packed_linear(x, packed), w):
            raise RuntimeError(f"batch_invariant: oneDNN's GEMM on this CPU gives a row of {name} "
                               f"{tuple(w.shape)} other bits among other rows")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU in anonymous memory, which the OS zeroes a page at a time as it is
    first written: a pool costs nothing to make (torch.zeros writes every page: 0.5 s a GiB) and
    holds memory for the blocks used so far. Freed (unmapped) with the tensor."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape)
    return torch.frombuffer(mmap.mmap(-1, max(n * dtype.itemsize, 1)), dtype=dtype, count=n).view(shape)


def _clone(model: CausalLM) -> CausalLM:
    """A copy of the model (its packed inference copies of weights are rebuilt by `prepack`)."""
    packed = {m: m.packed for m in model.modules() if isinstance(m, (Linear, Experts))}
    for m in packed:
        m.packed = None
    try:
        return copy.deepcopy(model)
    finally:
        for m, p in packed.items():
            m.packed = p


def draft_depths(parents: list[int]) -> list[int]:
    """Depth of each draft token below the sequence's last token (1 for its children)."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def tree_mask(parents: list[int], num_before: int) -> torch.Tensor:
    """[q, q] bool over this step's new tokens (num_before of the sequence, then the draft): each
    token sees the sequence's tokens and its own ancestors in the draft tree."""
    k = len(parents)
    q = num_before + k
    mask = torch.ones(q, q, dtype=torch.bool).tril()
    anc = torch.zeros(k, k, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    mask[num_before:, num_before:] = anc
    return mask
