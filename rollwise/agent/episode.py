"""The episode loop, strictly token-in-token-out, and `collect` for concurrent GRPO groups.

History is never re-rendered and re-tokenized: the first prompt is rendered once, then each turn
appends exactly the ids the generator returned and the ids of the rendered *observation delta*
(the chat template's text for the new messages plus the next generation prompt). So the trainer
sees the very ids the model saw and produced. An environment that starts a new context (`NewContext`:
an agent that summarised or trimmed its history, or a sub-agent's conversation) closes the tokens
so far as one sequence of the episode and renders the new context's messages as the next one's
prompt; if those tokens extend an earlier context's (the main conversation taken up again), that
context goes on with the rest as an observation instead.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from rollwise.agent.env import Continue, Env, NewContext, maybe_await
from rollwise.types import (GenerateOutput, GenerateRequest, SamplingParams, Trajectory, TurnRecord,
                            check_cut_off)
from rollwise.wire import encode_routing


class Generator(Protocol):
    """Token ids in, token ids + logprobs out (AsyncEngine; the router and HTTP clients later)."""

    tokenizer: object

    async def generate(self, request: GenerateRequest) -> GenerateOutput: ...


def text_content(content) -> str | None:
    """A chat message's content as text: a string as it is, None as "", a list of text parts
    (OpenAI's `{"type": "text", "text": ...}`, Anthropic's text blocks) joined with newlines, as vLLM
    joins them (so a policy trains on the prompt a vLLM deployment of it, or `rollwise serve`, renders);
    None for anything else."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    return None


class ChatRenderer:
    """Renders a conversation's first prompt and, later, only the delta of new messages."""

    _BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.eos = tokenizer.eos_token
        base = tokenizer.apply_chat_template(self._BASE, add_generation_prompt=False)
        self._base = base
        # what the template puts after the assistant's end-of-turn token (ChatML: "\n")
        self._after_eos = base[base.rfind(self.eos) + len(self.eos):] if self.eos and self.eos in base else ""

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        return self.tok.encode(self.tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools),
                               add_special_tokens=False)

    def delta_ids(self, new_messages: list[dict], ended_with_eos: bool) -> list[int]:
        full = self.tok.apply_chat_template(self._BASE + new_messages, add_generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("the chat template does not render conversations incrementally")
        text = ("" if ended_with_eos else (self.eos or "")) + self._after_eos + full[len(self._base):]
        return self.tok.encode(text, add_special_tokens=False)


class GenerationError(RuntimeError):
    """The generator (engine, router) could not serve a turn; the episode cannot be scored."""


async def run_episode(generator: Generator, env: Env, task: dict, params: SamplingParams, *,
                      trajectory_id: str = "traj-0", group_id: str | None = None, max_context: int = 4096,
                      deadline_s: float = 300.0, renderer: ChatRenderer | None = None,
                      policy_version: int | None = None) -> Trajectory:
    """One episode. Ends with status done, max_turns, max_context, timeout (the per-episode
    deadline) or error (the environment raised); the trajectory holds what was done until then.
    Its reward is the sum of its steps' rewards (each turn's in `TurnRecord.reward`), as a return
    in Gymnasium's sense: most envs reward only the last step.
    A generator failure raises `GenerationError` (such an episode says nothing about the policy).
    `policy_version`: every turn runs under that version's weights (the replicas must hold it)."""
    renderer = renderer or ChatRenderer(generator.tokenizer)
    traj = Trajectory(trajectory_id=trajectory_id, group_id=group_id, task=task)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(deadline_s):
            await _loop(generator, env, task, params, traj, renderer, max_context, policy_version)
    except TimeoutError:
        traj.status = "timeout"
    except GenerationError:
        raise  # the generator failed (not the policy, not the environment): the caller decides
    except Exception as e:  # noqa: BLE001 - an environment bug ends this episode, not the run
        traj.status, traj.error = "error", f"{type(e).__name__}: {e}"
    finally:
        close = getattr(env, "close", None)  # optional: e.g. an agent's session ends with its episode
        if close is not None:
            await maybe_await(close())
    traj.total_s = time.perf_counter() - t0
    for seq in traj.sequences():  # each context's last routing, encoded once (the log's JSON form)
        r = seq.routed_experts
        if r is not None and not isinstance(r, dict):
            seq.routed_experts = {"shape": list(r.shape), "data": encode_routing(r)}
    end = getattr(generator, "end_trajectory", None)  # e.g. a router: stickiness, turn stats, shared drafts
    if end is not None:
        await end(traj.trajectory_id, traj.group_id, traj.token_ids, traj.num_turns)
    return traj


async def _loop(generator, env, task, params, traj: Trajectory, renderer: ChatRenderer, max_context: int,
                policy_version: int | None) -> None:
    if hasattr(env, "bind_generator"):  # optional: the episode's generator, before reset (a user the policy plays)
        env.bind_generator(generator, renderer.tok, params, traj.trajectory_id)
    messages = await maybe_await(env.reset(task))
    schemas = [t.schema for t in getattr(env, "tools", [])] or None
    observe = getattr(env, "observe", None)  # optional: sees each turn's request and output before step
    turn_params = getattr(env, "turn_params", None)  # optional: this turn's sampling params from the run's
    state_key = getattr(env, "state_key", None)  # optional: the env's state before each turn (GiGPO's anchor)
    if hasattr(env, "bind_tokenizer"):  # optional: the policy's tokenizer (e.g. to spell out logprobs' tokens)
        env.bind_tokenizer(renderer.tok)
    traj.messages = list(messages)
    _extend(traj, renderer.prompt_ids(messages, schemas), None)
    eos_ids = {renderer.tok.eos_token_id}
    continued = False  # the last step wrote into the model's message (Continue)
    for turn in range(env.max_turns):
        room = max_context - len(traj.token_ids)
        if room <= 0:
            traj.status = "max_context"
            return
        seed = None if params.seed is None else hash((params.seed, turn)) & (2**63 - 1)
        p = dataclasses.replace(params, max_tokens=min(params.max_tokens, room), seed=seed)
        if turn_params is not None:
            p = turn_params(p)
        state = None if state_key is None else str(await maybe_await(state_key()))
        g0 = time.perf_counter()
        request = GenerateRequest(prompt_token_ids=list(traj.token_ids), params=p, trajectory_id=traj.trajectory_id,
                                  group_id=traj.group_id, turn=turn, policy_version=policy_version)
        try:
            out = await generator.generate(request)
        except Exception as e:
            raise GenerationError(str(e)) from e
        gen_s = time.perf_counter() - g0
        if observe is not None:
            observe(request, out)
        start = len(traj.token_ids)
        _extend(traj, out.token_ids, out.logprobs)
        if out.routed_experts is not None:  # the turn's prompt and output: the context so far (encoded at the end)
            traj.routed_experts = out.routed_experts
        text = renderer.tok.decode(p.text_ids(out.token_ids, out.finish_reason, eos_ids), p.skip_special_tokens)
        if continued:  # the env wrote into the model's message: this turn goes on with it
            traj.messages[-1]["content"] += text
        else:
            traj.messages.append({"role": "assistant", "content": text})
        traj.generation_s += gen_s
        record = TurnRecord(start=start, num_generated=len(out.token_ids), num_observation=0,
                            finish_reason=out.finish_reason, policy_version=out.policy_version,
                            num_cached_tokens=out.num_cached_tokens, generation_s=gen_s, tool_s=0.0,
                            replica=out.replica, version_segments=list(out.version_segments), state=state)
        traj.turns.append(record)  # (before the step: a step that raises or times out keeps its turn's record)
        s0 = time.perf_counter()
        try:
            obs, reward, done, info = await maybe_await(env.step(text))
        finally:
            record.tool_s = time.perf_counter() - s0
            traj.tool_s += record.tool_s
        for k, v in (info or {}).items():  # the env's numbers (tool calls, errors), summed over the episode
            if isinstance(v, (int, float)):
                traj.env_stats[k] = traj.env_stats.get(k, 0.0) + float(v)
        record.reward = float(reward or 0.0)
        if not math.isfinite(record.reward):  # NaN would reach every advantage of the group, then the weights
            raise ValueError(f"the environment's reward is {record.reward}, not a finite number")
        traj.reward += record.reward  # the return: every step's reward (an env may reward steps on the way)
        if done:
            traj.status = "done"
            return
        continued = isinstance(obs, Continue)
        if isinstance(obs, NewContext):  # the next turn reads a fresh prompt (or continues a context it extends)
            _switch_context(traj, list(obs), renderer.prompt_ids(list(obs), [t.schema for t in env.tools] or None))
            continue
        if continued:  # text in the model's message: its ids, as they are
            delta = renderer.tok.encode(str(obs), add_special_tokens=False)
        else:
            delta = renderer.delta_ids(obs, bool(out.token_ids) and out.token_ids[-1] in eos_ids)
        if len(traj.token_ids) + len(delta) >= max_context:
            traj.status = "max_context"
            return
        _extend(traj, delta, None)
        record.num_observation = len(delta)
        if continued:
            traj.messages[-1]["content"] += str(obs)
        else:
            traj.messages.extend(obs)
    traj.status = "max_turns"


def _switch_context(traj: Trajectory, messages: list[dict], prompt_ids: list[int]) -> None:
    """Make the context the next turn reads the current one (traj's own fields; the others are
    `traj.earlier`): the one whose tokens `prompt_ids` extends, with the rest of them appended as an
    observation (a conversation taken up again, e.g. an agent's after its sub-agent's), else a new one."""
    fields = ("token_ids", "loss_mask", "logprobs", "turns", "messages", "routed_experts")
    resumed = next((c for c in reversed(traj.sequences())
                    if len(prompt_ids) > len(c.token_ids) and prompt_ids[:len(c.token_ids)] == c.token_ids), None)
    if resumed is not traj:
        closed = Trajectory(trajectory_id=traj.trajectory_id, group_id=traj.group_id, task=traj.task)
        for f in fields:
            setattr(closed, f, getattr(traj, f))
            setattr(traj, f, getattr(resumed, f) if resumed is not None else None if f == "routed_experts" else [])
        traj.earlier = [c for c in traj.earlier if c is not resumed] + [closed]
    start = len(traj.token_ids)
    if traj.turns:  # the delta belongs to the context's last turn, as an observation does
        traj.turns[-1].num_observation += len(prompt_ids) - start
    _extend(traj, prompt_ids[start:], None)
    traj.messages = list(messages)


def _extend(traj: Trajectory, ids: list[int], logprobs: list[float] | None) -> None:
    traj.token_ids.extend(ids)
    traj.loss_mask.extend([0 if logprobs is None else 1] * len(ids))
    traj.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


async def run_attempts(generator: Generator, env_factory: Callable[[], Env], task: dict, params: SamplingParams, *,
                       retries: int = 0, retry_on: tuple[str, ...] = ("error",), backoff_s: float = 1.0,
                       **episode_options) -> Trajectory:
    """`run_episode` on a fresh env, run again from the start when it ends with a status in `retry_on`
    (an environment or agent that raised, by default) or the generator fails (`GenerationError`, after
    the router's own failover; a wait of `backoff_s`, doubling, lets a replica come back), at most
    `retries` more times. The last attempt stands (a generator failure then raises), with why each
    earlier one was dropped in `Trajectory.retried`. Attempt j > 0 samples with seed
    stable_seed(seed, j), so retried runs stay reproducible and attempt 0 is the plain episode."""
    check_cut_off("retry_on", retry_on)
    dropped: list[str] = []
    for attempt in range(retries + 1):
        p = params if attempt == 0 or params.seed is None else dataclasses.replace(
            params, seed=stable_seed(params.seed, attempt))
        try:
            traj = await run_episode(generator, env_factory(), task, p, **episode_options)
        except GenerationError as e:
            if attempt == retries:
                raise
            dropped.append(f"generation: {e}")
            await asyncio.sleep(backoff_s * 2**attempt)
            continue
        if traj.status not in retry_on or attempt == retries:
            traj.retried = dropped
            return traj
        dropped.append(f"{traj.status}: {traj.error}" if traj.error else traj.status)
    raise AssertionError("unreachable")


def stable_seed(*parts) -> int:
    """A seed from parts that is the same in every process (str hashes are salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 2


async def collect(generator: Generator, env_factory: Callable[[], Env], tasks: list[dict], params: SamplingParams,
                  *, group_size: int = 8, max_concurrency: int = 256, retries: int = 0,
                  retry_on: tuple[str, ...] = ("error",), **episode_options) -> AsyncIterator[list[Trajectory]]:
    """Run `group_size` episodes per task (a GRPO group), at most `max_concurrency` at once (a new
    episode starts as soon as one ends), and yield each group as soon as all its episodes are done.
    An episode that errs is run again up to `retries` times (`run_attempts`)."""
    renderer = episode_options.pop("renderer", None) or ChatRenderer(generator.tokenizer)
    slots = asyncio.Semaphore(max_concurrency)
    done: asyncio.Queue = asyncio.Queue()

    async def episode(task: dict, gid: str, k: int) -> Trajectory:
        async with slots:
            p = params if params.seed is None else dataclasses.replace(params, seed=stable_seed(params.seed, gid, k))
            return await run_attempts(generator, env_factory, task, p, retries=retries, retry_on=retry_on,
                                      trajectory_id=f"{gid}/{k}", group_id=gid, renderer=renderer, **episode_options)

    async def group(i: int, task: dict) -> None:
        gid = str(task.get("id", i))
        try:
            await done.put(await asyncio.gather(*(episode(task, gid, k) for k in range(group_size))))
        except BaseException as e:  # surfaces in the consumer instead of hanging it
            await done.put(e)

    runners = [asyncio.create_task(group(i, t)) for i, t in enumerate(tasks)]
    try:
        for _ in runners:
            item = await done.get()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        for r in runners:
            r.cancel()
