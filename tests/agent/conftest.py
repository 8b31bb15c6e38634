from __future__ import annotations

import asyncio

import pytest


@pytest.fixture
def expert_rewards():
    """Each task's reward when its env's scripted expert plays it (a fresh env per task, made by `make`)."""
    async def solve(make, task) -> float:
        env = make()
        await env.reset(task)
        for action in env.expert(task):
            _, reward, done, _ = await env.step(action)
            if done:
                return reward
        return 0.0

    def rewards(make, tasks) -> list[float]:
        async def go():
            return [await solve(make, t) for t in tasks]
        return asyncio.run(go())
    return rewards
