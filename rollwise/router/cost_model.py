"""What a replica's time goes to, learned from its own counters: over each polling interval,
busy seconds ~= a * prefill tokens + b * decode tokens + c * steps (non-negative least squares
over recent intervals, all replicas pooled: they run the same model). Policies that price
placements in seconds read (a, b, c) from here instead of guessing.

And what one more sequence in a replica's batch costs the others: with n sequences running, each
waits n / tokens_per_s seconds per token it generates, ~= alpha + beta * n (the same fit over the
replicas' snapshots). This is measured where it matters, speculation included: at a small batch a
step verifies several drafted tokens per sequence, so the per-token time grows with the batch
faster than the step time does."""
from __future__ import annotations

from collections import deque

import numpy as np

from rollwise.router.replica import LoadSnapshot


class CostModel:
    def __init__(self, window: int = 200, prior: tuple[float, float, float] = (2e-4, 4e-4, 1e-2)) -> None:
        self.samples: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self.last: dict[str, LoadSnapshot] = {}
        self.a, self.b, self.c = prior  # s per prefill token, s per decode token, s per step
        self.rates: deque[tuple[float, float]] = deque(maxlen=2 * window)  # (running, s per token per sequence)

    def observe(self, name: str, snap: LoadSnapshot | None) -> None:
        if snap is None:
            return
        if snap.running >= 1 and snap.tokens_per_s > 0:
            self.rates.append((snap.running, snap.running / snap.tokens_per_s))
        if snap.busy_s is None:
            return
        prev = self.last.get(name)
        self.last[name] = snap
        if prev is None or prev.busy_s is None:
            return
        d = (snap.prefill_tokens - prev.prefill_tokens, snap.decode_tokens - prev.decode_tokens,
             snap.steps - prev.steps, snap.busy_s - prev.busy_s)
        if d[2] > 0 and d[3] > 0:
            self.samples.append(d)

    def fit(self) -> tuple[float, float, float]:
        if len(self.samples) >= 8:
            x = np.array([s[:3] for s in self.samples], dtype=float)
            y = np.array([s[3] for s in self.samples], dtype=float)
            coef = nnls(x, y)
            if coef is not None:
                self.a, self.b, self.c = (float(v) for v in coef)
        return self.a, self.b, self.c

    def token_time(self) -> tuple[float, float] | None:
        """(alpha, beta): seconds per generated token of one sequence ~= alpha + beta * running;
        None until there are enough snapshots. Known bias: snapshots taken while a replica
        prefills count as slow decode tokens, so early in a step alpha reads far too high and beta
        zero. Fitting on decode intervals only fixes the measurement but made `rollwise`'s moves
        worse at high load (docs/simulator-notes.md): the move rule must be revisited with it."""
        if len(self.rates) < 16:
            return None
        x = np.array([(1.0, n) for n, _ in self.rates])
        coef = nnls(x, np.array([t for _, t in self.rates]))
        return None if coef is None else (float(coef[0]), float(coef[1]))


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """Least squares with non-negative coefficients: columns whose coefficient comes out negative
    are dropped and the rest refit (few unknowns, so this simple active-set loop is enough)."""
    n = x.shape[1]
    active = list(range(n))
    for _ in range(n):
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all():
            out = np.zeros(n)
            out[active] = coef
            return out
        active = [a for a, c in zip(active, coef) if c > 0]
        if not active:
            return None
    return None
