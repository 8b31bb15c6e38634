"""A Linear layer with a fast CPU inference path.

On CPU, PyTorch's default GEMM is slow for the skinny matrices of decoding (2-64 rows: at 2 or 3
rows 3-7x slower than at 1); oneDNN with a pre-packed weight runs them 2-4x faster, and a single row
too once the weight is large (MKL's GEMV is faster for one row times a small weight). The dense
weight stays the source of truth (training, saving, weight sync); `repack()` refreshes the packed
copy after it changes.

Batch invariance (`EngineConfig.batch_invariant`): oneDNN's packed GEMM gives a row the same bits
whatever the other rows (its reduction order does not depend on the row count, from 2 rows up;
`check_invariant` verifies this on the CPU it runs on), but a single row through MKL's GEMV rounds
differently. `batch_invariant` layers therefore send every row through oneDNN, so a request's
logits do not depend on what shares its batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollwise.engine import lora

MIN_ROWS = 4  # oneDNN's products are padded to at least this many rows (its kernel for fewer rounds otherwise)
GEMM_MIN_ROWS = 2  # from this many rows every product goes to oneDNN (MKL's GEMM takes 3-7x longer at 2-3 rows)
GEMV_MAX_WEIGHTS = 1 << 18  # one row times a weight smaller than this: MKL's GEMV (4-16 us against 16-30)
# below this many FLOPs a GEMM runs on one thread: waking a second (OpenMP's passive wait, rollwise/omp.py)
# costs ~50 us, more than such a product takes (a 128 x 384 layer at 16 rows: 65 us on two threads,
# 18 on one); oneDNN gives the same bits on one thread as on two
SERIAL_FLOPS = 16e6


def bucket_rows(m: int) -> int:
    """oneDNN builds a kernel per row count, at a cost of ~0.5 ms each time a new one is seen: above
    64 rows, round up to a multiple of 16 so a long run sees a bounded set (<= 25% padding)."""
    return m if m <= 64 else (m + 15) // 16 * 16


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """w [out, in] in oneDNN's layout for `packed_linear`; None where oneDNN cannot take it."""
    if w.device.type == "cpu" and w.dtype in ONEDNN_DTYPES:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
    return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, in] times a packed weight (rows padded to MIN_ROWS, then to `bucket_rows`)."""
    m = x.shape[0]
    mp = max(MIN_ROWS, bucket_rows(m))
    xp = F.pad(x, (0, 0, 0, mp - m)) if mp != m else x
    threads = torch.get_num_threads()
    if threads == 1 or 2 * mp * x.shape[1] * packed.shape[0] >= SERIAL_FLOPS:
        return torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")[:m]
    torch.set_num_threads(1)
    try:
        return torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")[:m]
    finally:
        torch.set_num_threads(threads)


def check_invariant(fn, w: torch.Tensor, rows: tuple[int, ...] = (1, 2, 3, 5, 17, 70, 300)) -> bool:
    """Whether fn (x [m, in] -> [m, out], the product with w) gives each of random rows the same bits
    alone and among others."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(rows), w.shape[1], generator=g).to(w.dtype)
    with torch.inference_mode():
        alone = torch.cat([fn(x[i:i + 1]) for i in range(len(x))])
        return all(torch.equal(fn(x[:m]), alone[:m]) for m in rows)


def _onednn_ok(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN takes packed weights of `dtype` (bf16 needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT: on an AVX2 CPU such layers run through F.linear)."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), 16)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(MIN_ROWS, 8, dtype=dtype), w, None, "none", [], "")
        return bool(torch.allclose(y.float(), torch.full((MIN_ROWS, 8), 8.0)))
    except (AttributeError, RuntimeError):
        return False


ONEDNN_DTYPES = {d for d in (torch.float32, torch.bfloat16)
                 if torch.backends.mkldnn.is_available() and _onednn_ok(d)}


class Linear(nn.Linear):
    packed: torch.Tensor | None = None
    lora_key: str = ""  # its module name, under which LoRA adapters keep their deltas for it
    batch_invariant: bool = False  # every row count through oneDNN (see above)

    def repack(self) -> None:
        self.packed = pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and not torch.is_grad_enabled() and (
                x.shape[0] >= GEMM_MIN_ROWS or self.batch_invariant or self.weight.numel() >= GEMV_MAX_WEIGHTS):
            y = packed_linear(x, self.packed, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        return lora.add_deltas(self.lora_key, x, y) if lora.plan() else y
