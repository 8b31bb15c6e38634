"""The one place that runs the model: builds the flat batch, owns the KV cache, returns logits."""
from __future__ import annotations

import torch

from rollwise.config import EngineConfig
from rollwise.engine.attention import build_metadata
from rollwise.engine.models.llama import CausalLM
from rollwise.engine.models.loader import TORCH_DTYPES, load_model, load_state_dict, load_weights
from rollwise.engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, cfg: EngineConfig, max_model_len: int) -> None:
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device)
        self.model: CausalLM = load_model(cfg.model, cfg.dtype, cfg.device, max_positions=max_model_len)
        self.model.prepack()
        mc = self.model.config
        self.block_size = cfg.block_size
        dtype = TORCH_DTYPES[cfg.dtype]
        bytes_per_block = 2 * mc.num_layers * cfg.block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize
        self.num_blocks = cfg.num_kv_blocks or max(2, int(cfg.kv_cache_gb * 2**30 // bytes_per_block))
        shape = (mc.num_layers, self.num_blocks * cfg.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_cache = (torch.zeros(shape, dtype=dtype, device=self.device),
                         torch.zeros(shape, dtype=dtype, device=self.device))

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """One forward over all scheduled tokens; logits [num sampling seqs, vocab] in batch order."""
        ids, positions, last_rows, row = [], [], [], 0
        for s in batch:
            c, n = s.num_computed_before, s.num_new_tokens
            ids.extend(s.seq.token_ids[c:c + n])
            positions.extend(range(c, c + n))
            row += n
            if s.samples:
                last_rows.append(row - 1)
        meta = build_metadata([s.num_new_tokens for s in batch], [s.num_computed_before for s in batch],
                              [s.seq.block_table for s in batch], self.block_size, self.device)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        hidden = self.model(t(ids), t(positions), meta, self.kv_cache)
        return self.model.logits(hidden[t(last_rows)])

    @torch.inference_mode()
    def update_weights(self, weights: dict[str, torch.Tensor] | str) -> None:
        state = load_state_dict(weights) if isinstance(weights, str) else weights
        load_weights(self.model, state, partial=True)
        self.model.prepack()
