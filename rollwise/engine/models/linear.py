"""A Linear layer with a fast CPU inference path.

On CPU, PyTorch's default GEMM is slow for the skinny matrices of decoding (4-64 rows); oneDNN with a
pre-packed weight runs them 2-4x faster. The dense weight stays the source of truth (training,
saving, weight sync); `repack()` refreshes the packed copy after it changes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollwise.engine import lora

MIN_ROWS = 4  # below this the default GEMV path is faster


def bucket_rows(m: int) -> int:
    """oneDNN builds a kernel per row count, at a cost of ~0.5 ms each time a new one is seen: above
    64 rows, round up to a multiple of 16 so a long run sees a bounded set (<= 25% padding)."""
    return m if m <= 64 else (m + 15) // 16 * 16


def _onednn_ok() -> bool:
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), 16)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(MIN_ROWS, 8), w, None, "none", [], "")
        return bool(torch.allclose(y, torch.full((MIN_ROWS, 8), 8.0)))
    except (AttributeError, RuntimeError):
        return False


ONEDNN = torch.backends.mkldnn.is_available() and _onednn_ok()


class Linear(nn.Linear):
    packed: torch.Tensor | None = None
    lora_key: str = ""  # its module name, under which LoRA adapters keep their deltas for it

    def repack(self) -> None:
        self.packed = None
        w = self.weight
        if ONEDNN and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.shape[0] >= MIN_ROWS and not torch.is_grad_enabled():
            m = x.shape[0]
            mp = bucket_rows(m)
            y = torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, mp - m)) if mp != m else x, self.packed,
                                                   self.bias, "none", [], "")[:m]
        else:
            y = F.linear(x, self.weight, self.bias)
        return lora.add_deltas(self.lora_key, x, y) if lora.plan() else y
