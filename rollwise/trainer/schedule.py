"""The RL learning rate by step: linear warm-up, then constant or cosine decay to a floor (verl's
`lr_warmup_steps`, `warmup_style`, `min_lr_ratio`). A function of the step alone, so a resumed run
picks it up from the policy version it resumes at."""
from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine")


def check(schedule: str, warmup: int, min_ratio: float) -> None:
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}; valid: {list(LR_SCHEDULES)}")
    if warmup < 0 or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"need lr_warmup_steps >= 0 and 0 <= min_lr_ratio <= 1, got {warmup}, {min_ratio}")


def lr_factor(step: int, warmup: int = 0, schedule: str = "constant", total: int = 0, min_ratio: float = 0.0) -> float:
    """The multiple of the base learning rate at optimizer step `step` (0-based): (step + 1) / warmup
    during the warm-up; then 1 ("constant"), or a half cosine from 1 to `min_ratio` over the steps
    from the warm-up's end to `total` ("cosine"; `total` 0: constant)."""
    warm = min(1.0, (step + 1) / warmup) if warmup else 1.0
    if schedule != "cosine" or total <= warmup:
        return warm
    progress = min(max((step - warmup) / (total - warmup), 0.0), 1.0)
    return warm * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
