"""The producer, read top to bottom: it admits groups under the staleness bound (the queue's), runs
each (one task, `group_size` episodes through the router) and hands it to the queue when complete;
the task stream is the training tasks in order, cycled (`cursor`: the place in it).

Skipping tasks before their rollouts (`pre_rollout_explore` < 1; GRESO: Zheng et al. 2025, "Act Only
When It Pays: Efficient Reinforcement Learning for LLM Reasoning via Selective Rollouts").

A group whose episodes all got the same reward teaches GRPO nothing (DAPO's dynamic sampling drops it
after it ran), and a task that gave such a group is likely to give another: one the policy always
solves, or never does. So before a task's next group runs, count z, its groups in a row up to now that
taught nothing; with z > 0 the task is skipped (no rollouts at all) with probability 1 - explore^z,
at most 1 - MIN_RUN, so it is still tried now and then and comes back once it teaches again.
`explore` = 1 never skips.

GRESO's adaptive exploration (`target` > 0, `pre_rollout_target`): the probability is kept apart for
tasks whose last such group was solved by every episode (easy: the common reward > 0) and by none
(hard), both starting at `explore`, and after each step each moves by STEP toward letting that
kind be target/3 (easy) or 2 target/3 (hard) of the groups the step took: lower (skip more) when
they were more. The values after step v are kept by version, and a group admitted under version v
is decided with v's: a deterministic run still decides alike however it is timed.

Every decision is a function of the run's seed, the task's place in the task stream (the cursor) and
the outcomes of the same task's earlier groups, which it waits for while they run: a deterministic run
makes the same decisions however it is timed. Skipped places are appended to a file beside the run's
group log, so a resumed run neither runs them nor decides them again.
"""
from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

from rollwise.agent.episode import run_attempts, stable_seed
from rollwise.rollout.pipeline import Group
from rollwise.types import SamplingParams


MIN_RUN = 0.05  # a task is run at least this often, however long its streak (one visit in 20)
STEP = 0.01  # GRESO's adjustment of an exploration probability per step


class PreRolloutFilter:
    def __init__(self, num_tasks: int, explore: float, seed: int = 0, path: str | Path | None = None,
                 target: float = 0.0, teaches=None) -> None:
        if not 0.0 < explore <= 1.0:
            raise ValueError(f"pre_rollout_explore must be in (0, 1] (1: never skip), got {explore}")
        if not 0.0 <= target < 1.0:
            raise ValueError(f"pre_rollout_target must be in [0, 1) (0: a fixed explore), got {target}")
        self.n, self.explore, self.seed, self.target, self.teaches = num_tasks, explore, seed, target, teaches
        self.by_version: dict[int, dict[str, float]] = {0: {"easy": explore, "hard": explore}}  # (adaptive)
        self.path = None if path is None else Path(path)
        # task -> {cursor: True if its group taught something, else "easy" or "hard" (False: "hard")}
        self.history: dict[int, dict[int, bool | str]] = {}
        self.running: dict[int, set[int]] = {}  # task -> cursors of its groups in flight
        self.skipped: set[int] = set()  # cursors skipped
        self.new_skips = 0  # since `take_count` last ran
        self._changed = asyncio.Condition()
        if self.path is not None and self.path.exists():
            self.skipped = {json.loads(line)["task_index"] for line in self.path.read_text().splitlines() if line}

    def outcome(self, trajs: list) -> bool | str:
        """A group's outcome: True if it teaches, else "easy" (every episode's reward the same and > 0)
        or "hard"."""
        return True if self.teaches(trajs) else "easy" if trajs[0].reward > 0 else "hard"

    def restore(self, outcomes: dict[int, bool | str], by_version: dict | None = None) -> None:
        """The logged groups' outcomes (cursor -> `outcome`) and the adaptive probabilities by version
        (the checkpoint's), from before a resume."""
        for idx, taught in outcomes.items():
            self.history.setdefault(idx % self.n, {})[idx] = taught
        self.by_version.update({int(v): p for v, p in (by_version or {}).items()})

    def streak(self, idx: int) -> tuple[int, str]:
        """The task's groups before `idx`, in a row back from the latest, that taught nothing, and the
        latest one's kind ("easy" or "hard")."""
        z, kind = 0, "hard"
        earlier = sorted(((i, t) for i, t in self.history.get(idx % self.n, {}).items() if i < idx), reverse=True)
        for _, taught in earlier:
            if taught is True:
                break
            kind = kind if z else taught or "hard"
            z += 1
        return z, kind

    def decide(self, idx: int, z: int, kind: str = "hard", version: int = 0) -> bool:
        """Skip the group at `idx` after `z` groups in a row that taught nothing? Probability 1 - p^z
        (at most 1 - MIN_RUN), p the explore (adaptive: the kind's, as of `version`), drawn from the
        run's seed and `idx` alone."""
        p = self.by_version[max(v for v in self.by_version if v <= version)][kind] if self.target else self.explore
        return z > 0 and random.Random(stable_seed(self.seed, idx, "pre-rollout")).random() >= max(p ** z, MIN_RUN)

    def adapt(self, version: int, groups: list[list]) -> dict[str, float]:
        """After the step that made `version`, from the outcomes of the groups it took (each a list of
        trajectories): each kind's probability one STEP down if its share was over its target, else up
        (in [MIN_RUN, 1])."""
        if not self.target or not groups:
            return {}
        outcomes = [self.outcome(g) for g in groups]
        was = self.by_version[max(v for v in self.by_version if v < version)] if version else self.by_version[0]
        now = {}
        for kind, aim in (("easy", self.target / 3), ("hard", self.target * 2 / 3)):
            share = sum(o == kind for o in outcomes) / len(outcomes)
            now[kind] = min(1.0, max(MIN_RUN, was[kind] + (-STEP if share > aim else STEP)))
        self.by_version[version] = now
        return {"pre_rollout_p_easy": now["easy"], "pre_rollout_p_hard": now["hard"]}

    async def skip(self, idx: int, version: int = 0) -> bool:
        """Whether to skip the group at cursor `idx`, admitted under `version` (recorded if so); waits
        for the task's earlier groups."""
        task = idx % self.n
        async with self._changed:
            await self._changed.wait_for(lambda: not any(i < idx for i in self.running.get(task, ())))
        z, kind = self.streak(idx)
        if not self.decide(idx, z, kind, version):
            self.running.setdefault(task, set()).add(idx)
            return False
        self.skipped.add(idx)
        self.new_skips += 1
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"task_index": idx, "streak": z}) + "\n")
        return True

    async def done(self, idx: int, taught: bool | str | None) -> None:
        """The group at `idx` completed (`taught`: its `outcome`), or failed (None: no outcome)."""
        task = idx % self.n
        if taught is not None:
            self.history.setdefault(task, {})[idx] = taught
        async with self._changed:
            self.running.get(task, set()).discard(idx)
            self._changed.notify_all()

    def take_count(self) -> int:
        """Tasks skipped since the last call (a step's metric)."""
        n, self.new_skips = self.new_skips, 0
        return n


def turn_params(cfg, temperature: float, seed: int | None, **more) -> SamplingParams:
    """A run's sampling of one turn (rollouts and evaluations alike): the temperature and seed given,
    the run's max_tokens, repetition_detection and thinking_token_budget."""
    return SamplingParams(temperature=temperature, max_tokens=cfg.max_tokens, seed=seed,
                          repetition_detection=cfg.repetition_detection,
                          thinking_token_budget=cfg.thinking_token_budget, **more)


async def produce(cfg, queue, router, make_env, tasks: list[dict], cursor: int, done: set[int],
                  skips: PreRolloutFilter | None = None) -> None:
    """Admit groups under the staleness bound and run them; a complete group goes to the queue.
    `done`: cursors not to run (logged before a resume, or skipped); `skips`: the pre-rollout filter."""
    slots = asyncio.Semaphore(cfg.max_concurrent_groups)
    running: set[asyncio.Task] = set()

    async def group(seq: int, version: int, idx: int) -> None:
        task = tasks[idx % len(tasks)]
        gid, taught = f"s{seq}", None
        n = cfg.group_size + (cfg.advantage == "remax")  # ReMax's baseline: one more episode, greedy, not trained on

        def episode(k: int):
            greedy = k == cfg.group_size
            params = turn_params(cfg, 0.0 if greedy else cfg.temperature, stable_seed(cfg.seed, idx, k),
                                 return_routed_experts=cfg.routing_replay != "off" and not greedy)
            return run_attempts(router, make_env, task, params, retries=cfg.episode_retries,
                                retry_on=tuple(cfg.retry_statuses), trajectory_id=f"{gid}/{'greedy' if greedy else k}",
                                group_id=gid, deadline_s=cfg.episode_deadline_s,
                                policy_version=version if cfg.deterministic else None)
        try:
            trajs = list(await asyncio.gather(*map(episode, range(n))))
            if n > cfg.group_size:
                baseline = trajs.pop()
                for t in trajs:
                    t.baseline = baseline.reward
            taught = skips.outcome(trajs) if skips is not None else None
            await queue.put(Group(seq, idx, task, version, trajs))
        except Exception as e:  # noqa: BLE001 - surfaces in the trainer instead of hanging it
            await queue.fail(e)
        finally:
            if skips is not None:
                await skips.done(idx, taught)
            slots.release()

    try:
        while True:
            await slots.acquire()
            seq, version = await queue.admit()
            while cursor in done or (skips is not None and await skips.skip(cursor, version)):  # logged, or skipped
                cursor += 1
            t = asyncio.create_task(group(seq, version, cursor))
            cursor += 1
            running.add(t)
            t.add_done_callback(running.discard)
    except Exception as e:  # noqa: BLE001
        await queue.fail(e)
    finally:
        for t in running:
            t.cancel()
