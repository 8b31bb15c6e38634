"""What a step's episodes were like, for its metrics (turns, tokens, how they ended, the env's counts)."""
from __future__ import annotations

from rollwise.types import Trajectory


def episode_stats(trajs: list[Trajectory]) -> dict[str, float]:
    """What the step's episodes were like, each a mean over them: turns, generated tokens, the share
    that ended with each status other than done (status_max_turns, ...), and the numbers the env
    reported (env_<key>: tool calls, errors, searches per episode)."""
    n = max(len(trajs), 1)
    m = {"turns": sum(t.num_turns for t in trajs) / n, "generated_per_episode": sum(t.num_generated for t in trajs) / n}
    for s in sorted({t.status for t in trajs} - {"done"}):
        m[f"status_{s}"] = sum(t.status == s for t in trajs) / n
    greedy = [t.baseline for t in trajs if t.baseline is not None]
    if greedy:  # (remax: the greedy episodes' rewards, what the policy does without sampling)
        m["greedy_reward"] = sum(greedy) / len(greedy)
    for k in sorted({k for t in trajs for k in t.env_stats}):
        m[f"env_{k}"] = sum(t.env_stats.get(k, 0.0) for t in trajs) / n
    return m
