"""The trainer's forward of a micro-batch: the decoder's last hidden states, with a prefix the rows
share (a GRPO group's prompt) run once and its KV shared by the rows, gradient checkpointing or not
(policy.py's `PolicyModel.logprobs` and the critic's values)."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollwise.trainer.policy import Batch


def decoder_states(body, batch: Batch, cache_kw: str, min_shared: int = 32,
                   route=lambda rows, cols: nullcontext()) -> tuple[torch.Tensor, int]:
    """The decoder's last hidden states that predict targets `off`..L-2 of the batch, and `off`. Rows
    that start with the same tokens (`batch.shared`: a GRPO group's prompt; every episode's system
    prompt and tool schemas) have that prefix run once and its KV shared by the batch: exact (the
    same states, and gradients flow back through the shared KV), several times cheaper when the
    prompt dominates; `off` is then the prefix's length less one (no target before it is generated).
    `route(rows, cols)`: a context to run the forward of those rows and positions in (MoE routing).
    Under gradient checkpointing (`enable_checkpointing`) the prefix runs whole (one row) and the rest
    checkpointed, reading the prefix's KV from layers that do not grow, so that a layer's replay in
    the backward sees the keys its forward saw."""
    from transformers import DynamicCache
    p, n = batch.shared, batch.input_ids.shape[0]
    kv = DynamicCache(config=body.config) if p >= min_shared and batch.input_ids.shape[1] - p >= 1 else None
    replay = kv is not None and torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False)
                                                                 for m in body.modules())
    if kv is None or replay and any(type(layer) is not _cache_layers()[0] for layer in kv.layers):
        # (no shared prefix; or sliding-window layers, which drop keys as they go, checkpointed)
        with route(slice(None), slice(None)):
            return body(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state[:, :-1], 0
    with route(slice(0, 1), slice(0, p)), _checkpointing(body, False) if replay else nullcontext():
        pre = body(input_ids=batch.input_ids[:1, :p], use_cache=True, **{cache_kw: kv}).last_hidden_state
    kv.batch_repeat_interleave(n)
    if replay:  # the prefix's KV read by the checkpointed layers, which replay in the backward
        kv.layers = [_read_only(layer) for layer in kv.layers]
    with route(slice(None), slice(p, None)):
        rest = body(input_ids=batch.input_ids[:, p:], attention_mask=batch.attention_mask, use_cache=not replay,
                    **{cache_kw: kv}).last_hidden_state  # position p.. -> targets p..
    return torch.cat([pre[:, -1:].expand(n, 1, -1), rest[:, :-1]], dim=1), p - 1  # targets p-1..L-2


@contextmanager
def _checkpointing(body, on: bool):
    """The decoder's layers checkpointed or not while inside."""
    mods = [m for m in body.modules() if hasattr(m, "gradient_checkpointing")]
    was = [m.gradient_checkpointing for m in mods]
    try:
        for m in mods:
            m.gradient_checkpointing = on
        yield
    finally:
        for m, w in zip(mods, was):
            m.gradient_checkpointing = w


def _read_only(layer):
    """The layer's keys and values in a cache layer that gives them followed by a forward's own without
    keeping those: a layer's forward and its replay in the backward see the same keys."""
    ro = _cache_layers()[1]()
    ro.__dict__.update(layer.__dict__)
    return ro


@cache
def _cache_layers():
    """transformers' DynamicLayer and its read-only subclass (transformers imported on first use)."""
    from transformers.cache_utils import DynamicLayer

    class ReadOnlyLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
    return DynamicLayer, ReadOnlyLayer
