"""Worker extensions as RL trainers ship them for vLLM (`worker_extension_cls`), used by test_worker.py
and the weight-route tests: OpenRLHF's process-group sync (on gloo here: the trainer, rank 0,
broadcasts each weight) and prime-rl's file sync. Each writes through `self.model_runner.model`."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class GlooSync:
    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
        self._group = dist.ProcessGroupGloo(store, rank_offset + self.rank, world_size, timeout)

    def update_weight(self, name: str, dtype: str, shape: list[int]) -> None:
        weight = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
        self._group.broadcast(weight, 0).wait()
        self.model_runner.model.load_weights(weights=[(name, weight)])


class FileSync:
    def update_weights_from_path(self, path: str) -> str:
        from safetensors.torch import load_file
        loaded = self.model_runner.model.load_weights(load_file(path).items())
        return f"{len(loaded)} weights"


class Clashing:
    def get_model(self):  # the worker's own: vLLM refuses such an extension
        return None
