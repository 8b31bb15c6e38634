"""Paged attention over a flat batch of variable-length queries.

The KV cache of one layer is a pool of slots `[num_blocks * block_size, num_kv_heads, head_dim]`; a
sequence's keys live in the blocks its block table names. Each step writes the new keys to their
slots, then gathers every sequence's blocks (whole blocks: few, large copies) into a padded batch and
runs one SDPA per group of sequences with similar query lengths (decodes together, prefill chunks
together), so a long prefill chunk does not pad the decodes.

On CPU in fp32 the native kernel (`_C.paged_attention`, see native.py; `EngineConfig.native_attention`,
on by default for head sizes 32, 64 and 128) takes every group instead: it reads keys and values where
they lie, and what a row computes depends only on the keys it sees, so the same row gives the same
bits in a prefill chunk, a decode step or a draft chain (seeded sampling stays reproducible with
prefix caching). The torch path stays as its oracle and for bf16, other devices, other head sizes
by default, and tree drafts of more than 64 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rollwise.engine import native
from rollwise.engine.models import linear

# head sizes the native kernel's vector path takes (32, 64, 128; its loop path takes the rest): the
# default for EngineConfig.native_attention; none when the kernels are not built
VECTOR_HEAD_SIZES: tuple[int, ...] = native._C.VECTOR_HEAD_SIZES if native._C is not None else ()
MAX_SHORT = 64  # short queries (drafts, short prompts) get their own group; a tree's mask fits 64 bits


@dataclass(slots=True)
class NativeQueries:
    """A group's queries as the native kernel reads them: query i sees the first prefix[i] keys of
    its sequence and, of the next 64, those in masks[i] (bit j: key prefix[i] + j)."""
    rows: np.ndarray  # [R] int64 row of each query in the flat batch
    seqs: np.ndarray  # [R] its sequence in the group
    prefix: np.ndarray  # [R] causal rows: position + 1; tree drafts: the keys cached before the step
    masks: np.ndarray  # [R] int64 tree drafts: their ancestors among the step's new tokens; else 0


@dataclass(slots=True)
class AttentionGroup:
    q_index: torch.Tensor  # [B, Lq] rows of the flat batch (padding repeats a valid row)
    block_tables: torch.Tensor  # [B, nb] blocks of each sequence (padding points at block 0, masked)
    mask: torch.Tensor | None  # [B, 1, Lq, nb * block_size] bool; None when every key is visible
    out_rows: torch.Tensor | None  # [N] flat rows this group produces; None: all rows, in order
    out_select: torch.Tensor | None  # [N] positions in the flattened [B * Lq] result that hold them
    native: NativeQueries | None  # for the native kernel; None: not asked for, or a tree too long for it


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup]
    block_size: int
    use_native: bool = False  # the native kernel takes the groups it can (CPU, fp32)


def build_metadata(
    q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], block_size: int,
    device: torch.device, tree_masks: dict[int, torch.Tensor] | None = None, use_native: bool = False,
) -> AttentionMetadata:
    """q_lens[i] new tokens of sequence i follow ctx_lens[i] tokens already in the cache and take the
    next q_lens[i] slots. Without a tree mask they attend causally; `tree_masks[i]` ([q, q] bool:
    token a sees new token b) replaces causality among the new tokens of sequence i (a token tree
    whose branches share the context but not each other)."""
    q = torch.tensor(q_lens, dtype=torch.long)
    c = torch.tensor(ctx_lens, dtype=torch.long)
    width = max(len(bt) for bt in block_tables)  # padded with block 0 (masked); one array, not a tensor a row
    bt = torch.from_numpy(np.array([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=np.int64))
    starts = torch.cumsum(q, 0) - q
    # slot of every new token: its sequence's block at position // block_size, then the offset
    seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), q)
    pos = c[seq_of_row] + torch.arange(int(q.sum())) - starts[seq_of_row]
    slot_mapping = bt[seq_of_row, pos // block_size] * block_size + pos % block_size
    # decodes, short queries (verification of drafts) and long prefill chunks each get their own
    # padded batch, so nobody is padded to a long chunk
    groups = [
        _group(sel.nonzero().flatten(), q, c, bt, starts, block_size, device, tree_masks or {}, use_native)
        for sel in (q == 1, (q > 1) & (q <= MAX_SHORT), q > MAX_SHORT) if bool(sel.any())
    ]
    return AttentionMetadata(slot_mapping.to(device), groups, block_size, use_native)


def _group(idx, q_all, c_all, bt_all, starts_all, block_size, device, tree_masks, use_native) -> AttentionGroup:
    q, c, bt, s = q_all[idx], c_all[idx], bt_all[idx], starts_all[idx]
    lq = int(q.max())
    nb = -(-int((c + q).max()) // block_size)
    lk = nb * block_size
    j = torch.arange(lq)
    valid_q = j[None, :] < q[:, None]  # [B, Lq]
    # padded query columns repeat the sequence's last row; their output is dropped
    q_index = s[:, None] + torch.minimum(j[None, :], q[:, None] - 1)
    mask = None
    if lq > 1 or bool(((c + q) != lk).any()):
        q_pos = c[:, None] + torch.minimum(j[None, :], q[:, None] - 1)  # absolute position of each query
        mask = (torch.arange(lk)[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
        for b, i in enumerate(idx.tolist()):
            if i in tree_masks:
                n, ci = int(q[b]), int(c[b])
                mask[b, 0, :n, ci:ci + n] = tree_masks[i]
        mask = mask.to(device)
    out_select = valid_q.flatten().nonzero().flatten()
    out_rows = q_index.flatten()[out_select]
    if len(out_rows) == int(q_all.sum()) and bool(valid_q.all()) and bool((out_rows == torch.arange(len(out_rows))).all()):
        out_rows = out_select = None  # this group is the whole batch, in order
    else:
        out_rows, out_select = out_rows.to(device), out_select.to(device)
    trees = [(b, tree_masks[i]) for b, i in enumerate(idx.tolist()) if i in tree_masks]
    native = _native_queries(q, c, s, valid_q, trees) if use_native and (lq <= MAX_SHORT or not trees) else None
    return AttentionGroup(q_index.to(device), bt[:, :nb].contiguous().to(device), mask, out_rows, out_select, native)


def _native_queries(q, c, s, valid_q, trees) -> NativeQueries:
    j = torch.arange(valid_q.shape[1])[None, :].expand_as(valid_q)
    prefix = c[:, None] + j + 1  # causal: every key up to its own
    masks = torch.zeros_like(prefix)
    for b, tree in trees:  # [n, n]: token a sees new token b
        n = int(q[b])
        prefix[b, :n] = c[b]
        masks[b, :n] = (tree.long() << torch.arange(n)).sum(-1)  # distinct bits: the sum is their OR (bit 63 too)
    seqs = torch.arange(len(q))[:, None].expand_as(valid_q)
    return NativeQueries((s[:, None] + j)[valid_q].numpy(), seqs[valid_q].numpy(), prefix[valid_q].numpy(),
                         masks[valid_q].numpy())


def parallel_pairs() -> int:
    """The (key, query head) pairs from which the native kernel splits a call across threads. The
    linear policy measured on this machine (models/linear.py) names the flops from which a GEMM gains
    from waking a second thread (`serial_flops`); one thread does a decode pair in about the time it
    does 2,000 of a GEMM's flops (~20 ns against ~100 GFLOP/s), so the same wake-up pays from
    serial_flops / 2048 pairs. Within [2048, 65536]: 4,096 on 2026-12-05's machine, where the split
    decoded 1.13x / 1.18x faster at batch 32 / 64 than the fixed 65,536 before."""
    return int(min(65536, max(2048, linear.policy()["serial_flops"] / 2048)))


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    """q [T, H, D]; k, v [T, Hkv, D]; caches [S, Hkv, D]. Writes k, v to the cache, returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    _, hkv, d = k_cache.shape
    k_blocks = k_cache.view(-1, meta.block_size, hkv, d)
    v_blocks = v_cache.view(-1, meta.block_size, hkv, d)
    out = None
    for g in meta.groups:
        b, nb = g.block_tables.shape
        lq = g.q_index.shape[1]
        if meta.use_native and g.native is not None and native.ENABLED and q.device.type == "cpu" \
                and q.dtype == torch.float32:
            if out is None:
                out = torch.empty_like(q)
            nq = g.native
            native._C.paged_attention(q.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(),
                                      g.block_tables.numpy(), nq.rows, nq.seqs, nq.prefix, nq.masks, out.numpy(),
                                      meta.block_size, d ** -0.5, parallel_pairs(), native.LANES)
            continue
        # index_select copies whole rows and is ~2x faster than advanced indexing here
        qg = q.index_select(0, g.q_index.flatten()).view(b, lq, -1, d).transpose(1, 2)  # [B, H, Lq, D]
        flat = g.block_tables.flatten()
        kg = k_blocks.index_select(0, flat).view(b, nb * meta.block_size, hkv, d).transpose(1, 2)  # [B, Hkv, Lk, D]
        vg = v_blocks.index_select(0, flat).view(b, nb * meta.block_size, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, enable_gqa=True)
        o = o.transpose(1, 2).reshape(-1, q.shape[1], d)  # [B * Lq, H, D]
        if g.out_rows is None:
            return o
        if out is None:
            out = torch.empty_like(q)
        out[g.out_rows] = o[g.out_select]
    return out
