"""A Linear layer with a fast CPU inference path.

On CPU, PyTorch's default GEMM is slow for the skinny matrices of decoding (4-64 rows); oneDNN with a
pre-packed weight runs them 2-4x faster. The dense weight stays the source of truth (training,
saving, weight sync); `repack()` refreshes the packed copy after it changes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 4  # below this the default GEMV path is faster


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

    def repack(self) -> None:
        self.packed = None
        w = self.weight
        if ONEDNN and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.shape[0] >= MIN_ROWS and not torch.is_grad_enabled():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
