"""Paged attention over a flat batch of variable-length queries.

The KV cache of one layer is a pool of slots `[num_blocks * block_size, num_kv_heads, head_dim]`; a
sequence's keys live in the slots its block table names. Each step writes the new keys to their slots,
then gathers every sequence's context into a padded batch and runs one SDPA per group of sequences
with similar query lengths (decodes together, prefill chunks together), so a long prefill chunk does
not pad the decodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionGroup:
    q_index: torch.Tensor  # [B, Lq] rows of the flat batch (padding repeats a valid row)
    kv_slots: torch.Tensor  # [B, Lk] cache slots (padding points at slot 0)
    mask: torch.Tensor | None  # [B, 1, Lq, Lk] bool, None when every key is visible (decode, equal lengths)
    out_rows: torch.Tensor  # [N] flat rows this group produces
    out_select: torch.Tensor  # [N] positions in the flattened [B * Lq] result that hold them


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup]


def build_metadata(
    q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """q_lens[i] new tokens of sequence i follow ctx_lens[i] tokens already in the cache."""
    q = torch.tensor(q_lens, dtype=torch.long)
    c = torch.tensor(ctx_lens, dtype=torch.long)
    width = max(len(bt) for bt in block_tables)
    bt = torch.zeros(len(q_lens), width, dtype=torch.long)
    for i, table in enumerate(block_tables):
        bt[i, : len(table)] = torch.tensor(table, dtype=torch.long)
    starts = torch.cumsum(q, 0) - q
    # slot of every new token: its sequence's block at position // block_size, then the offset
    seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), q)
    pos = c[seq_of_row] + torch.arange(int(q.sum())) - starts[seq_of_row]
    slot_mapping = bt[seq_of_row, pos // block_size] * block_size + pos % block_size
    is_decode = q == 1
    groups = [
        _group(sel.nonzero().flatten(), q, c, bt, starts, block_size, device)
        for sel in (is_decode, ~is_decode) if bool(sel.any())
    ]
    return AttentionMetadata(slot_mapping.to(device), groups)


def _group(idx, q_all, c_all, bt_all, starts_all, block_size, device) -> AttentionGroup:
    q, c, bt, s = q_all[idx], c_all[idx], bt_all[idx], starts_all[idx]
    lq, lk = int(q.max()), int((c + q).max())
    j = torch.arange(lq)
    valid_q = j[None, :] < q[:, None]  # [B, Lq]
    # padded query columns repeat the sequence's last row; their output is dropped
    q_index = s[:, None] + torch.minimum(j[None, :], q[:, None] - 1)
    key_pos = torch.arange(lk)
    kv_slots = bt[:, key_pos // block_size] * block_size + key_pos % block_size  # [B, Lk]
    mask = None
    if lq > 1 or bool(((c + q) != lk).any()):
        q_pos = c[:, None] + torch.minimum(j[None, :], q[:, None] - 1)  # absolute position of each query
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1).to(device)
    out_select = valid_q.flatten().nonzero().flatten()
    out_rows = q_index.flatten()[out_select]
    return AttentionGroup(q_index.to(device), kv_slots.to(device), mask, out_rows.to(device),
                          out_select.to(device))


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    """q [T, H, D]; k, v [T, Hkv, D]; caches [S, Hkv, D]. Writes k, v to the cache, returns [T, H, D]."""
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    out = torch.empty_like(q)
    for g in meta.groups:
        qg = q[g.q_index].transpose(1, 2)  # [B, H, Lq, D]
        kg = k_cache[g.kv_slots].transpose(1, 2)  # [B, Hkv, Lk, D]
        vg = v_cache[g.kv_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, enable_gqa=True)
        b, h, lq, d = o.shape
        out[g.out_rows] = o.transpose(1, 2).reshape(b * lq, h, d)[g.out_select]
    return out
