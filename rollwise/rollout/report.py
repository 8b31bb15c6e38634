"""What a training run shows and leaves behind: a live status line (a tqdm bar for the RL steps)
and the report folder (metrics.json and PNG curves)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    steps = report["steps"]
    if not steps:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = [s["step"] for s in steps]
    fig, ax = plt.subplots(2, 2, figsize=(10, 7))
    ax[0, 0].plot(x, [s["reward"] for s in steps])
    ax[0, 0].axhline(report.get("sft_success") or 0, ls="--", c="gray", label="SFT eval success")
    ax[0, 0].axhline(report.get("rl_success") or 0, ls=":", c="green", label="RL eval success")
    evals = [(s["step"], s["eval_success"]) for s in steps if s.get("eval_success") is not None]
    if evals:
        ax[0, 0].plot(*zip(*evals), "o-", c="purple", label="eval success (every eval_every steps)")
    ax[0, 0].set(title="training reward (mean per step)", xlabel="step")
    ax[0, 0].legend()
    acc = _diff([s.get("spec_accepted", 0) for s in steps])
    sp = _diff([s.get("spec_steps", 0) for s in steps])
    es = _diff([s.get("engine_steps", 0) for s in steps])
    ax[0, 1].plot(x, acc, label="accepted draft tokens")
    ax[0, 1].set(title="speculation per training step", xlabel="step")
    ax2 = ax[0, 1].twinx()
    ax2.plot(x, [min(a, b) / max(b, 1) for a, b in zip(sp, es)], c="orange", label="share of engine steps speculating")
    ax[0, 1].legend(loc="upper left")
    ax2.legend(loc="upper right")
    ax[1, 0].plot(x, [s["wait_s"] for s in steps], label="trainer waiting for rollouts")
    ax[1, 0].plot(x, [s["train_s"] for s in steps], label="trainer computing")
    ax[1, 0].set(title="seconds per step", xlabel="step")
    ax[1, 0].legend()
    ax[1, 1].plot(x, [s["max_staleness"] for s in steps], label="max staleness (versions)")
    ax[1, 1].plot(x, [s.get("prefix_hit_rate", 0) for s in steps], label="prefix-cache hit rate")
    ax[1, 1].set(title="staleness and cache", xlabel="step")
    ax[1, 1].legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)


def _diff(xs: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0] + xs[:-1], xs)]


class Status:
    """A live status line on a terminal (a tqdm bar for the RL steps), plain lines otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.tty = enabled, sys.stderr.isatty()
        self._last = 0.0

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
        elif now - self._last > 5.0:
            print(text, file=sys.stderr, flush=True)
            self._last = now

    def done(self, text: str = "") -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r\033[K")
        if self.enabled and text:
            print(text, file=sys.stderr, flush=True)

    def bar(self, total: int, initial: int = 0):
        return _Bar(self, total, initial)


class _Bar:
    def __init__(self, status: Status, total: int, initial: int) -> None:
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=initial, desc="GRPO", disable=not status.enabled, file=sys.stderr,
                        mininterval=0 if status.tty else 5.0)
        self._prev: dict = {}

    def update(self, m: dict) -> None:
        acc = m.get("spec_accepted", 0) - self._prev.get("spec_accepted", 0)
        # (read while the replicas step, the two counters can be a step apart: the share is capped at 1)
        steps = m.get("engine_steps", 0) - self._prev.get("engine_steps", 0)
        spec = min(m.get("spec_steps", 0) - self._prev.get("spec_steps", 0), steps)
        self._prev = m
        self.bar.set_postfix_str(f"reward {m['reward']:.2f} | accepted/step {acc / max(steps, 1):.2f} | spec "
                                 f"{'on' if spec else 'off'} {spec / max(steps, 1):.0%} | hit {m.get('prefix_hit_rate', 0):.2f} | "
                                 f"stale {m['max_staleness']} | trainer idle {m['wait_s']:.1f}s", refresh=False)
        if m.get("eval_success") is not None:  # a line of its own, kept above the bar
            self.bar.write(f"step {m['step']}: eval success {m['eval_success']:.3f}")
        self.bar.update(1)
        if self.bar.n >= self.bar.total:
            self.bar.close()
