"""Environments. `Env` is the protocol the episode loop drives; `ToolEnv` is the base of the built-in
ones: it parses tool calls from the model's text, runs them (concurrently, each with its deadline)
and ends on a plain answer or a `finish` call (with a `user`, rollwise.agent.users, a plain answer
goes to the user, who answers it or ends the conversation)."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import time
import weakref
from typing import Any, Protocol

from rollwise.agent.parsing import HermesParser, ToolCall, ToolCallParser, bind, make_parser
from rollwise.agent.reasoning import make_reasoning_parser
from rollwise.agent.tools import Latency, Tool, ToolCache

Observation = list[dict]  # new chat messages (role "tool" or "user") for the model
FEEDBACK_CHARS = 1000  # of a failing run's output, as `ToolEnv.feedback` tells it (its end: the traceback's)


class NewContext(list):
    """What `step` returns instead of new messages to go on in a fresh context: the whole
    conversation the model sees next (e.g. the task and a summary of the work so far), rendered
    afresh with the env's tools as they are then. The episode's tokens so far become a sequence of
    their own (`Trajectory.earlier`), trained with the same advantage; if the new prompt's tokens
    extend an earlier context's, that context goes on instead. `max_turns` counts the episode's
    turns, `max_context` each context's tokens."""


class Continue(str):
    """What `step` returns instead of new messages to write text into the model's own message, as
    Search-R1 does with its search results (`<information>...</information>`): the text's tokens
    follow the turn's output at once (no chat template, no end of turn; not trained on) and the
    next turn goes on writing the same assistant message. The turn should have ended on a stop
    string (`turn_params`), not on its end-of-turn token."""


class Env(Protocol):
    max_turns: int
    tools: list[Tool]

    def reset(self, task: dict) -> list[dict] | Any: ...  # first messages (may be a coroutine)

    def step(self, action: str) -> tuple[Observation, float, bool, dict] | Any: ...  # may be a coroutine

    def sample_tasks(self, n: int, seed: int) -> list[dict]: ...

    def expert(self, task: dict) -> list[str]: ...  # assistant messages of a scripted solution

    # step may return a NewContext (a list of messages) or a Continue (text) in place of the observation.
    # optional: turn_params(params) -> params gives a turn's sampling params from the run's (e.g. a
    # request's stop strings); observe(request, output) sees each turn's generation before step;
    # close() (may be a coroutine) runs when the episode ends, however it ends; state_key() (may be a
    # coroutine) names the env's state before each turn, kept in TurnRecord.state: GiGPO's step groups
    # then compare the turns taken from equal keys rather than from equal observation tokens;
    # bind_tokenizer(tok) gets the policy's tokenizer before the first turn; bind_generator(generator,
    # tok, params, trajectory_id) the episode's generator before reset (ToolEnv: a user the policy plays)


async def maybe_await(x):
    return await x if inspect.isawaitable(x) else x


_PER_LOOP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {key: object}


def loop_shared(key, make):
    """The one object per running event loop and `key`, made by `make()` on first use (a judge's
    client, an agent server's processes: what every episode of a run shares); it goes with its loop."""
    objects = _PER_LOOP.setdefault(asyncio.get_running_loop(), {})
    if key not in objects:
        objects[key] = make()
    return objects[key]


def loop_forget(key) -> None:
    """This loop's `key` has ended (a server that stopped): the next `loop_shared` makes another."""
    _PER_LOOP.get(asyncio.get_running_loop(), {}).pop(key, None)


class ToolEnv:
    """Subclasses set `name`, `system_prompt`, implement `make_tools`, `prompt`, `score`,
    `sample_tasks` and `expert`; a tool may end the episode by calling `self.end(reward)`."""

    name = "tool_env"
    system_prompt = "You are a helpful agent. Use the tools when they help, then answer."
    answer_hint = "When you are done, reply with the answer alone, without a tool call."

    def __init__(self, *, max_turns: int = 8, tool_timeout: float = 5.0, tool_latency: Latency | None = None,
                 parser: ToolCallParser | str | None = None, max_calls_per_turn: int = 8, mcp=None,
                 tool_cache: bool = False, user=None, reasoning: str | None = "qwen3") -> None:
        self.max_turns, self.tool_timeout = max_turns, tool_timeout
        # pure tools' results reused within the run, by task and arguments (ToolCache; `Tool.pure`)
        self.tool_cache, self._cache_hits = tool_cache, 0
        self.tool_latency, self.max_calls_per_turn = tool_latency, max_calls_per_turn
        # the model's tool-call format: a parser, or its name (`env_options = { parser = "llama3_json" }`)
        self.parser = make_parser(parser) if isinstance(parser, str) else parser or HermesParser()
        self._parser = self.parser  # (bound to the tools at reset)
        # a thinking model's reasoning (`<think>...</think>`) is neither parsed for calls nor scored
        self.reasoning = make_reasoning_parser(reasoning)
        self.task: dict | None = None
        self._ended: float | None = None
        self.tools: list[Tool] = []
        # tools of MCP servers besides the env's own (`mcp = "mcp.json"` or a table; rollwise.agent.mcp_tools)
        self.mcp = None
        if mcp is not None:
            from rollwise.agent.mcp_tools import MCPTools
            self.mcp = MCPTools(mcp)
        # a user the agent's replies go to, who answers or ends the conversation (rollwise.agent.users)
        self._new_user = None
        if user is not None:
            from rollwise.agent.users import user_factory
            self._new_user = user_factory(user)
        self._user, self._dialogue = None, []
        self._policy = None  # (generator, tokenizer, params, trajectory id): the episode's (bind_generator)

    # to implement --------------------------------------------------------------------------------
    def make_tools(self, task: dict) -> list[Tool]:
        raise NotImplementedError

    def prompt(self, task: dict) -> str:
        raise NotImplementedError

    def score(self, task: dict, answer: str) -> float:  # or a coroutine (a verifier that waits on I/O)
        raise NotImplementedError

    def feedback(self, task: dict, answer: str) -> str | None:  # or a coroutine
        """What the env can tell the agent about a wrong answer (a failing test's output), for a
        user giving feedback (`user = { kind = "feedback", details = true }`); None: nothing."""
        return None

    def call_text(self, tool: str, /, **arguments) -> str:
        """A call of `tool` as the model writes it in the env's format (`parser`): what an
        expert's transcript says, so a warm start teaches the format the policy is parsed by."""
        write = getattr(self.parser, "write", None)
        return (write or HermesParser().write)([ToolCall(tool, arguments)])

    # the protocol --------------------------------------------------------------------------------
    def bind_generator(self, generator, tok, params, trajectory_id: str) -> None:
        """The episode's generator, the policy's tokenizer and the run's sampling, before reset (a
        user the policy plays generates with them)."""
        self._policy = (generator, tok, params, trajectory_id)

    def turn_params(self, params):
        """The run's sampling; with a parser whose markup is special tokens (`kimi_k2`,
        `deepseek_v31`), each reply decoded with them kept, so that its calls can be read."""
        if getattr(self.parser, "special_tokens", False) and params.skip_special_tokens:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def end(self, reward: float) -> None:
        self._ended = reward

    async def reset(self, task: dict) -> list[dict]:
        await self.set_up(task)
        first = "\n".join(x for x in (self.prompt(task), self.answer_hint) if x)
        return await self.begin_dialogue([{"role": "system", "content": self.system_prompt},
                                          {"role": "user", "content": first}])

    async def set_up(self, task: dict) -> None:
        """The episode's state and tools (the env's own, its MCP servers', `finish`), before its messages."""
        self.task, self._ended = task, None
        own = self.make_tools(task)
        served = await self.mcp.tools(task) if self.mcp is not None else []
        clash = sorted({t.name for t in own} & {t.name for t in served})
        if clash:
            raise ValueError(f"MCP tools {clash} have the names of the env's own tools")
        self.tools = own + served + [_finish_tool()]
        for t in self.tools:
            if t.timeout is not None:  # (None: a tool that keeps its own deadline)
                t.timeout = min(t.timeout, self.tool_timeout)
            t.latency = t.latency or self.tool_latency
        self._by_name = {t.name: t for t in self.tools}
        self._parser = bind(self.parser, [t.schema for t in self.tools])  # (schemas type qwen3_coder's values)

    async def begin_dialogue(self, messages: list[dict]) -> list[dict]:
        """An episode's first messages, with its user (if any) met: a user who speaks first (its
        `opening`) writes the only user message, and what the env would have said joins the system
        message as the agent's instructions. A subclass that writes its own first messages passes
        them through this."""
        self._user = self._new_user() if self._new_user is not None else None
        if hasattr(self._user, "bind") and self._policy is not None:  # a user the policy plays
            self._user.bind(*self._policy)
        opening = getattr(self._user, "opening", None)
        opening = await maybe_await(opening(self.task)) if opening is not None else None
        if opening is not None:
            if any(m.get("role") not in ("system", "user") for m in messages):
                raise ValueError("a user who speaks first needs tasks without earlier assistant or tool messages")
            told = "\n\n".join(c for m in messages if (c := (m.get("content") or "").strip()))
            messages = [{"role": "system", "content": told}, {"role": "user", "content": opening}]
        self._dialogue = [{"role": m["role"], "content": m.get("content") or ""}
                          for m in messages if m.get("role") in ("user", "assistant")]
        return messages

    @property
    def user_opens(self) -> bool:
        """The env's users may write the first message (a task then needs no prompt of its own)."""
        return bool(getattr(self._new_user, "opens", False))

    async def step(self, action: str) -> tuple[Observation, float, bool, dict]:
        if self.reasoning is not None:
            action = self.reasoning.split(action)[1]
        parsed = self._parser.parse(action)
        finish = next((c for c in parsed.calls if c.name == "finish"), None)
        if finish is not None:
            if self._user is not None:  # (an answer, as a plain reply is)
                return await self._to_user(str(finish.arguments.get("answer", "")))
            reward = await maybe_await(self.score(self.task, str(finish.arguments.get("answer", ""))))
            return [], reward, True, {"answer": finish.arguments}
        if not parsed.calls and not parsed.errors:
            if self._user is not None:
                return await self._to_user(parsed.text)
            return [], await maybe_await(self.score(self.task, parsed.text)), True, {"answer": parsed.text}
        t0 = time.perf_counter()
        obs = [{"role": "tool", "content": e} for e in parsed.errors]
        calls = parsed.calls[: self.max_calls_per_turn]
        if len(parsed.calls) > len(calls):
            obs.append({"role": "tool", "content": f"error: at most {self.max_calls_per_turn} tool calls per turn"})
        self._cache_hits = 0
        results = await asyncio.gather(*(self._call(c) for c in calls))
        obs.extend({"role": "tool", "content": r} for r in results)
        info = {"tool_s": time.perf_counter() - t0, "num_calls": len(calls), "num_errors": len(parsed.errors)}
        if self.tool_cache:
            info["tool_cache_hits"] = self._cache_hits
        if self._ended is not None:
            return obs, self._ended, True, info
        return obs, 0.0, False, info

    async def _to_user(self, text: str) -> tuple[Observation, float, bool, dict]:
        """A reply to the user: the user's answer is the next message, or the conversation ends with
        the user's reward (or the env's score of this reply)."""
        self._dialogue.append({"role": "assistant", "content": text})
        task = self.task

        async def score(answer: str) -> float:
            return float(await maybe_await(self.score(task, answer)))

        async def feedback(answer: str) -> str | None:
            return await maybe_await(self.feedback(task, answer))
        score.feedback = feedback  # (`score.feedback(answer)`: the env's words on it)
        reply = await maybe_await(self._user.reply(task, list(self._dialogue), score))
        if reply.content is None:
            reward = reply.reward if reply.reward is not None else await score(text)
            return [], float(reward), True, {"answer": text}
        self._dialogue.append({"role": "user", "content": reply.content})
        return [{"role": "user", "content": reply.content}], 0.0, False, {"user_replies": 1}

    async def close(self) -> None:
        """The episode has ended: servers started for it (MCP `scope = "episode"`) stop."""
        if self.mcp is not None:
            await self.mcp.close()

    async def _call(self, call) -> str:
        t = self._by_name.get(call.name)
        if t is None:
            return f"error: unknown tool {call.name!r}; available: {sorted(self._by_name)}"
        if not (self.tool_cache and t.pure):
            return (await t.call(call.arguments)).content
        key = (type(self).__qualname__, _task_key(self.task), t.name,
               json.dumps(call.arguments, sort_keys=True, default=repr))
        result, reused = await loop_shared("tool-cache", ToolCache).get(key, lambda: t.call(call.arguments))
        self._cache_hits += reused
        return result.content


def _task_key(task: dict | None) -> str:
    """A task's identity for the tool cache: its id, or its whole content."""
    if task and "id" in task:
        return f"id:{task['id']}"
    return "task:" + json.dumps(task, sort_keys=True, default=repr)


def _finish_tool() -> Tool:
    """Shown to the model; the env intercepts the call and ends the episode with its answer."""
    def finish(answer: str) -> str:
        """Give the final answer and end the episode."""
        return answer
    return Tool(finish)


def last_number(text: str) -> float | None:
    """The last number in a text (answers like 'The answer is 42.')."""
    import re
    nums = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return float(nums[-1]) if nums else None


def number_reward(answer: str, want: float | str) -> float:
    """1.0 when the answer's last number is `want` (to a millionth of it, or of 1 when smaller); a
    `want` given as text is its number ("1,234", "$18": data files' ground truths)."""
    if isinstance(want, str):
        try:
            want = float(want)
        except ValueError:
            text, want = want, last_number(want)
            if want is None:
                raise ValueError(f"the task's answer {text!r} has no number in it") from None
    got = last_number(answer)
    return float(got is not None and abs(got - float(want)) <= 1e-6 * max(1.0, abs(float(want))))


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation (Search-R1's and HotpotQA's exact match): lower case, no
    punctuation, no articles (a, an, the), single spaces."""
    import re
    import string
    text = str(text).lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(answer: str, want) -> float:
    """1.0 when the answer equals any of the wanted answers (a string or a list) after normalisation."""
    wants = want if isinstance(want, (list, tuple)) else [want]
    return float(any(normalize_answer(answer) == normalize_answer(w) for w in wants))


def f1_score(answer: str, want) -> float:
    """SQuAD's token F1 of the answer against the best of the wanted answers (normalised words)."""
    from collections import Counter
    best = 0.0
    got = normalize_answer(answer).split()
    for w in want if isinstance(want, (list, tuple)) else [want]:
        ref = normalize_answer(w).split()
        common = sum((Counter(got) & Counter(ref)).values())
        if common:
            p, r = common / len(got), common / len(ref)
            best = max(best, 2 * p * r / (p + r))
    return best
