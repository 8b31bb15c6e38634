"""Experiment trackers a run reports its step metrics to, beside its own steps.jsonl and report:
TensorBoard (event files in RUN_DIR/tensorboard) and Weights & Biases, as verl's `trainer.logger`
names them. Each is an optional package, imported when the run starts; a run that
names one that is not installed stops before any work with the pip command that installs it.

Metrics go as scalars under their step's number (lists and strings are left to steps.jsonl); a
resumed run goes on at the step it resumes from (W&B resumes the same run, by an id kept in the run
directory)."""
from __future__ import annotations

import importlib.util
import math
import uuid
from pathlib import Path

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # name -> the package it needs


def check_trackers(names) -> None:
    """ValueError naming the valid trackers, or the pip command for a missing package."""
    bad = sorted(set(names) - set(TRACKERS))
    if bad:
        raise ValueError(f"unknown loggers {bad}; valid: {sorted(TRACKERS)}")
    missing = [TRACKERS[n] for n in names if importlib.util.find_spec(TRACKERS[n]) is None]
    if missing:
        raise ValueError(f"loggers {list(names)} need {missing}: pip install {' '.join(missing)}")


def scalars(metrics: dict) -> dict[str, float]:
    """The metrics a tracker can plot: finite numbers (bools as 0/1)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = float(v)
    return out


class Trackers:
    def __init__(self, names, run_dir: str | Path, config: dict, project: str = "rollwise") -> None:
        check_trackers(names)
        self.run_dir, self.sinks = Path(run_dir), []
        name = self.run_dir.resolve().name
        for n in names:
            if n == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                w = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
                w.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in sorted(config.items())), 0)
                self.sinks.append((lambda m, s, w=w: [w.add_scalar(k, v, s) for k, v in m.items()], w.close))
            elif n == "wandb":
                import wandb
                id_file = self.run_dir / "wandb-id"  # the same W&B run when this one resumes
                run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
                id_file.parent.mkdir(parents=True, exist_ok=True)
                id_file.write_text(run_id + "\n")
                run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(self.run_dir),
                                 config=config)
                self.sinks.append((lambda m, s, run=run: run.log(m, step=s), run.finish))

    def log(self, metrics: dict, step: int) -> None:
        m = scalars(metrics)
        for log, _ in self.sinks:
            log(m, step)

    def close(self) -> None:
        for _, close in self.sinks:
            close()
        self.sinks = []

