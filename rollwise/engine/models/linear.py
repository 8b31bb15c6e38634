"""A Linear layer with a fast CPU inference path.

On CPU, which kernel is fastest for the skinny matrices of decoding (1-3 rows) depends on the CPU:
oneDNN with a pre-packed weight (padded to 4 rows) or MKL's GEMV / GEMM on the dense weight. On
one machine MKL's GEMM took 3-7x longer at 2-3 rows than at 1 and oneDNN won from 2 rows; on an
AVX-512 machine MKL won at 1-3 rows for every weight of the 32M model (1.5-2x the decode speed at
batch 1-3). So the choice is measured once per machine (`policy`: a few products timed both ways,
under a second) and kept in a file that every process on the machine reads, whatever its thread
count, so that processes compute alike (a server and its client compare tokens). From 4 rows every product
goes to oneDNN. The dense weight stays the source of truth (training, saving, weight sync);
`repack()` refreshes the packed copy after it changes. `ROLLWISE_LINEAR_POLICY`: "measured" (the
default), or a fixed one: "onednn" (2026-12-03's: oneDNN from 2 rows, and for one row from 2^18
weight entries; products under 16 MFLOP on one thread) or "mkl" (MKL below 4 rows, every product
on all threads).

Batch invariance (`EngineConfig.batch_invariant`): oneDNN's packed GEMM gives a row the same bits
whatever the other rows (its reduction order does not depend on the row count, from 2 rows up;
`check_invariant` verifies this on the CPU it runs on), but a single row through MKL's GEMV rounds
differently. `batch_invariant` layers therefore send every row through oneDNN, so a request's
logits do not depend on what shares its batch.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rollwise.engine import lora

MIN_ROWS = 4  # oneDNN's products are padded to at least this many rows (its kernel for fewer rounds otherwise)
INF = float("inf")
# a policy: for 1, 2 and 3 rows, the weight entries from which oneDNN takes the product (MKL below; inf:
# never), and the FLOPs below which a oneDNN product runs on one thread (waking a second under OpenMP's
# passive wait, rollwise/omp.py, costs ~50 us; oneDNN gives the same bits on one thread as on two)
FIXED = {"onednn": {"onednn_from": [1 << 18, 0, 0], "serial_flops": 16e6},
         "mkl": {"onednn_from": [INF, INF, INF], "serial_flops": 0.0}}
POLICIES = ("measured", *FIXED)
_policy: dict | None = None  # this process's, once known


def bucket_rows(m: int) -> int:
    """oneDNN builds a kernel per row count, at a cost of ~0.5 ms each time a new one is seen: above
    64 rows, round up to a multiple of 16 so a long run sees a bounded set (<= 25% padding)."""
    return m if m <= 64 else (m + 15) // 16 * 16


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """w [out, in] in oneDNN's layout for `packed_linear`; None where oneDNN cannot take it."""
    if w.device.type == "cpu" and w.dtype in ONEDNN_DTYPES:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
    return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  serial_flops: float | None = None) -> torch.Tensor:
    """x [m, in] times a packed weight (rows padded to MIN_ROWS, then to `bucket_rows`); products
    under `serial_flops` (default: the policy's) on one thread."""
    m = x.shape[0]
    mp = max(MIN_ROWS, bucket_rows(m))
    xp = F.pad(x, (0, 0, 0, mp - m)) if mp != m else x
    threads = torch.get_num_threads()
    serial = policy()["serial_flops"] if serial_flops is None else serial_flops
    if threads == 1 or 2 * mp * x.shape[1] * packed.shape[0] >= serial:
        return torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")[:m]
    torch.set_num_threads(1)
    try:
        return torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")[:m]
    finally:
        torch.set_num_threads(threads)


def policy() -> dict:
    """The kernel policy: `ROLLWISE_LINEAR_POLICY`'s fixed one, or the one measured on this machine
    (read from the cache file, or measured now and written there)."""
    global _policy
    if _policy is None:
        name = os.environ.get("ROLLWISE_LINEAR_POLICY", "measured")
        if name not in POLICIES:
            raise ValueError(f"ROLLWISE_LINEAR_POLICY must be one of {list(POLICIES)}, got {name!r}")
        _policy = FIXED[name] if name in FIXED else _measured()
    return _policy


def _machine() -> str:
    """What the measured policy depends on: the CPU, its features and torch."""
    cpu = platform.processor()
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in info if line.startswith("flags"))
        cpu += " " + " ".join(sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))))
    except (OSError, StopIteration):
        pass
    return f"{cpu} | torch {torch.__version__}"


def _measured() -> dict:
    """This machine's policy from the cache file, or measured now (on this process's threads, under
    a lock, so that processes starting at once measure once) and written there; measured in-process
    if the file cannot be."""
    key = _machine()
    path = Path(os.environ.get("ROLLWISE_CACHE", Path.home() / ".cache" / "rollwise")) / "linear-policy.json"
    try:
        import fcntl
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                known = json.loads(path.read_text()) if path.exists() else {}
            except ValueError:
                known = None
            if not isinstance(known, dict) or not isinstance(known.get(key, {}), dict):
                known = {}  # not this module's file (edited by hand?): measured again and rewritten
            if key not in known:
                known[key] = measure()
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(known, indent=1) + "\n")
                tmp.replace(path)
            return known[key]
    except (OSError, ValueError, ImportError):
        return measure()


def measure(sizes: tuple[int, ...] = (128, 256, 512, 1024, 2048)) -> dict:
    """Time both kernels on square weights of `sizes` (2^14 to 2^22 entries): first oneDNN on one
    thread against all at 4 rows (`serial_flops`: the FLOPs from which all threads win, at that size
    and every larger one), then at 1, 2 and 3 rows oneDNN against MKL (`onednn_from`: the weight
    entries from which oneDNN wins; below the smallest size, as at it)."""
    g = torch.Generator().manual_seed(0)

    def best(fn) -> float:  # the fastest of 3 rounds of 5 calls, after one that warms up
        fn()
        rounds = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            rounds.append(time.perf_counter() - t0)
        return min(rounds)

    def first_win(wins: list[bool], costs: list[float]) -> float:  # from where it wins at every larger size
        k = len(wins)
        while k and wins[k - 1]:
            k -= 1
        return costs[k] if k < len(wins) else INF

    with torch.inference_mode():
        ws = [torch.randn(n, n, generator=g) for n in sizes]
        packs = [pack(w) for w in ws]
        if any(p is None for p in packs):
            return FIXED["mkl"]
        wins = []
        for n, p in zip(sizes, packs):
            x = torch.randn(MIN_ROWS, n, generator=g)
            wins.append(best(lambda: packed_linear(x, p, serial_flops=0.0)) <
                        best(lambda: packed_linear(x, p, serial_flops=INF)))
        serial = first_win(wins, [2.0 * MIN_ROWS * n * n for n in sizes])
        onednn_from = []
        for m in (1, 2, 3):
            wins = []
            for n, w, p in zip(sizes, ws, packs):
                x = torch.randn(m, n, generator=g)
                wins.append(best(lambda: packed_linear(x, p, serial_flops=serial)) < best(lambda: F.linear(x, w)))
            onednn_from.append(first_win(wins, [n * n for n in sizes]))
    return {"onednn_from": onednn_from, "serial_flops": serial}


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
                x.shape[0] >= MIN_ROWS or self.batch_invariant
                or self.weight.numel() >= policy()["onednn_from"][x.shape[0] - 1]):
            y = packed_linear(x, self.packed, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        return lora.add_deltas(self.lora_key, x, y) if lora.plan() else y
