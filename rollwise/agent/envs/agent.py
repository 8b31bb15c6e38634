"""agent: an episode is a run of the user's agent, written against the OpenAI API (or Anthropic's).

    async def run(client, task) -> float    # client: openai.AsyncOpenAI on the policy

(chat completions here; the Responses API's requests are turned into the same: rollwise.agent.responses_api;
with `client = "anthropic"`, an anthropic.AsyncAnthropic, whose Messages API requests are too:
rollwise.agent.messages_api)

or a program in any language (`command = ["node", "agent.js"]`), run once per episode with
OPENAI_BASE_URL and OPENAI_API_KEY set to the gateway and the episode's key (what the OpenAI SDKs
read; ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY too, for Anthropic's), the task as one line of JSON
on stdin; the last line it prints is the reward. With `serve = true` the program instead stays up
and takes every episode as a JSON line (`rollwise.agent.agent_server`: `processes` of them, started
once).

The agent asks for chat completions, runs its own tools and returns the episode's reward. Each of
its requests is one turn of `run_episode`, so the trajectory stays token-in-token-out: the first
request's messages are rendered once by the policy's chat template, each reply is the generated ids
verbatim (tool calls in the policy's format, `parser`, Hermes by default, as OpenAI `tool_calls`;
a thinking policy's reasoning as `reasoning_content`, `reasoning`, default `qwen3`),
and each later request must send the conversation so far unchanged (the reply message appended, as
the openai SDK's `message` or its dict) followed by new messages (tool results, user turns): only
those are rendered, as the observation delta. A request that does not continue the conversation (an
agent that summarises, trims old tool results or changes its tools) starts a new context
(`on_rewrite = "new_context"`): its messages are rendered afresh as the prompt of the episode's next
token sequence (or continue an earlier one whose tokens they extend: a sub-agent's turn, then the
main agent's again), which the trainer trains with the same advantage as the first; `on_rewrite =
"error"` ends such an episode with status `error` instead.

Sampling is the run's (temperature, seed: the request's are ignored), so the logprobs are those
the trainer expects; a request's `stop` strings and a lower `max_tokens` apply to its turn, and
`logprobs` / `top_logprobs` give the reply the turn's tokens' logprobs (the trajectory's: every
generated token, tool-call markup and the end token included). A plain (not async) `run` gets an
`openai.OpenAI` client and runs in a thread of its own. Given a class, `agent_options` make an
instance; its `run` is the agent, and its `sample_tasks(n, seed)` and `expert(task)` (if any) give
training tasks and the SFT warm start's transcripts.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import inspect
import json
import os
import random
import shutil
import signal
import tempfile
import threading

from rollwise.agent.agent_server import AgentServer
from rollwise.agent.env import NewContext
from rollwise.agent.episode import stable_seed, text_content
from rollwise.agent.gateway import Gateway, GatewayError, Session, completion, httpx_of, pooled
from rollwise.agent.parsing import bind, make_parser, openai_tool_calls
from rollwise.agent.plugins import load_object
from rollwise.agent.reasoning import make_reasoning_parser

CLIENTS = ("openai", "anthropic")  # the SDK client an agent function gets: openai's, or anthropic's (Messages API)


class AgentEnv:
    name = "agent"

    def __init__(self, agent=None, *, command: list[str] | None = None, serve: bool = False, processes: int = 1,
                 max_turns: int = 8,
                 agent_options: dict | None = None, model: str = "policy", transport: str = "asgi",
                 on_rewrite: str = "new_context", parser: str = "hermes", reasoning: str | None = "qwen3",
                 client: str = "openai") -> None:
        if on_rewrite not in ("new_context", "error"):
            raise ValueError(f"on_rewrite {on_rewrite!r}: valid are 'new_context' (a request that does not continue "
                             "the conversation starts a new token sequence) and 'error' (it ends the episode)")
        if transport not in ("asgi", "http"):
            raise ValueError(f"transport {transport!r}: valid are 'asgi' (coroutine agents call the gateway's app "
                             "on the loop) and 'http' (through its socket, as plain-function agents do)")
        if client not in CLIENTS:
            raise ValueError(f"client {client!r}: valid are {list(CLIENTS)} (the SDK client the agent function gets)")
        self.max_turns, self.model, self.transport, self.on_rewrite = max_turns, model, transport, on_rewrite
        self.client = client
        self.command, self.serve, self.processes = command, serve, processes
        self.parser = make_parser(parser)  # the policy's tool-call format, read into the replies' tool_calls
        # a thinking policy's reasoning: the reply's `reasoning_content`, its calls read past it
        self.reasoning = make_reasoning_parser(reasoning)
        self.tools: list[_Schema] = []
        self._session: Session | None = None
        self._gateway = self._key = self._runner = self._output = None
        self._known: list[tuple] = []
        self._body: dict = {}
        self._tool_defs = self._parse = self._why = self._tok = None
        if (agent is None) == (command is None):
            raise ValueError("env 'agent' needs agent (a function or class: 'file.py:name') or command (a program "
                             "and its arguments, e.g. ['node', 'agent.js']), one of them")
        if command is not None:
            if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
                raise ValueError(f"command must be a non-empty list of strings (the program and its arguments), got {command!r}")
            if shutil.which(command[0]) is None:
                raise ValueError(f"command {command[0]!r} is not an executable on PATH or a path to one")
            if agent_options:
                raise ValueError(f"agent_options {sorted(agent_options)} need an agent class to pass them to")
            if processes < 1:
                raise ValueError(f"processes must be >= 1, got {processes}")
            self.run_agent = None
            return
        if serve:
            raise ValueError("serve = true runs a command as a long-lived agent server: set command")
        if importlib.util.find_spec(client) is None:
            raise ValueError(f"env 'agent' gives the agent an {client} client: pip install {client}")
        obj = load_object(agent, "agent") if isinstance(agent, str) else agent
        if inspect.isclass(obj):
            obj = obj(**(agent_options or {}))
        elif agent_options:
            raise ValueError(f"agent_options {sorted(agent_options)} need an agent class to pass them to")
        self.run_agent = getattr(obj, "run", obj)
        if not callable(self.run_agent):
            raise ValueError(f"agent {agent!r} is not a function or a class with a run(client, task) method")
        for m in ("sample_tasks", "expert"):
            if callable(getattr(obj, m, None)):
                setattr(self, m, getattr(obj, m))

    async def reset(self, task: dict) -> list[dict]:
        await self.close()
        self._why = self._output = None
        self._gateway = gateway = await Gateway.running()
        self._session = Session()
        self._key = gateway.register(self._session)
        self._runner = asyncio.create_task(self._run(gateway, self._key, task))
        kind, body = await self._session.events.get()
        if kind != "request":
            raise RuntimeError(f"the agent ended without asking the model anything ({_ending(kind, body)})")
        return self._context(body, self._messages(body))

    def _context(self, body: dict, messages: list[dict]) -> list[dict]:
        """The messages of a request that starts a context; its tools are the context's."""
        self._body = body
        self._known = [_norm(m) for m in messages]
        self._tool_defs = body.get("tools") or None
        self._parse = bool(self._tool_defs) and body.get("tool_choice") != "none"
        self.tools = [_Schema(t) for t in self._tool_defs or []]
        return messages

    def turn_params(self, params):
        """The run's sampling, with the request's stop strings and a lower max_tokens if it asks for
        one (neither changes the distribution a token is sampled from); special tokens kept where
        the tool-call format's markup is made of them (`kimi_k2`) and tools are offered."""
        limit = self._body.get("max_completion_tokens") or self._body.get("max_tokens") or params.max_tokens
        top = (self._body.get("top_logprobs") or 0) if self._body.get("logprobs") else 0
        keep = self._parse and getattr(self.parser, "special_tokens", False)
        return dataclasses.replace(params, max_tokens=min(params.max_tokens, limit),
                                   stop=list(params.stop) + self._stops(), logprobs=max(params.logprobs, top),
                                   skip_special_tokens=params.skip_special_tokens and not keep)

    def _stops(self) -> list[str]:
        stop = self._body.get("stop") or []
        return [stop] if isinstance(stop, str) else list(stop)

    def observe(self, request, output) -> None:
        """The turn's generate request and output (finish reason, token counts for `usage`, logprobs)."""
        self._output = (len(request.prompt_token_ids), output)

    def bind_tokenizer(self, tok) -> None:
        """The policy's tokenizer (the episode loop's), for the tokens of the replies' logprobs."""
        self._tok = tok

    def _logprobs(self) -> list[dict] | None:
        """The reply's `logprobs.content` if the request asks for them: every token the turn generated
        (the trajectory's: tool-call markup, text past a stop string and the end token included), with
        the request's `top_logprobs` most likely tokens at each position."""
        if not self._body.get("logprobs") or self._output is None or self._tok is None:
            return None
        from rollwise.serve.responses import chat_logprobs
        out, k = self._output[1], self._body.get("top_logprobs") or 0
        tops = [dict(list(top.items())[:k]) for top in out.top_logprobs] if k and out.top_logprobs else []
        return chat_logprobs(self._tok, out.token_ids, out.logprobs, tops)

    async def step(self, action: str) -> tuple[list[dict], float, bool, dict]:
        cut, stop = min(((i, s) for s in self._stops() if (i := action.find(s)) >= 0), default=(-1, None))
        if cut >= 0:  # OpenAI's content ends before the stop string (the trajectory keeps its tokens)
            action = action[:cut]
        thought, action = self.reasoning.split(action) if self.reasoning else (None, action)
        message, reason = {"role": "assistant", "content": action}, "stop"
        # ids the model wrote none for: from the reply and its place (a template that writes them back,
        # Mistral's, then reads the same tokens in a run that repeats)
        rng = random.Random(stable_seed(len(self._body.get("messages") or []), action))
        calls = openai_tool_calls(action, bind(self.parser, self._tool_defs), rng) if self._parse else None
        if calls is not None:
            message, reason = {"role": "assistant", "content": calls[0] or None, "tool_calls": calls[1]}, "tool_calls"
        if thought is not None:  # (what the agent sends back without it still continues the tokens the model wrote)
            message.update(content=message["content"] or None, reasoning_content=thought)
        usage = None
        if self._output is not None:
            n_prompt, out = self._output
            reason = "length" if out.finish_reason == "length" and calls is None else reason
            usage = {"prompt_tokens": n_prompt, "completion_tokens": len(out.token_ids),
                     "total_tokens": n_prompt + len(out.token_ids),
                     "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
        self._session.answer(completion(message, reason, self._body.get("model") or self.model, usage,
                                        self._logprobs(), stop if calls is None else None))
        self._known.append(_norm(message))
        kind, body = await self._session.events.get()
        if kind != "request":
            if kind == "fail":
                raise RuntimeError(f"the agent raised {_ending(kind, body)}")
            return [], float(body), True, {}
        messages = self._messages(body)
        why = self._rewrite(body, messages)
        if why is not None:
            if self.on_rewrite == "error":
                raise self._refuse(why)
            return NewContext(self._context(body, messages)), 0.0, False, {}
        self._body = body
        new = messages[len(self._known):]
        self._known.extend(_norm(m) for m in new)
        return new, 0.0, False, {}

    def _rewrite(self, body: dict, messages: list[dict]) -> str | None:
        """Why a request does not continue the conversation the model saw (None: it does)."""
        if (body.get("tools") or None) != self._tool_defs:
            return "the agent changed its tools (they are rendered once, in a context's first prompt)"
        old = [_norm(m) for m in messages[: len(self._known)]]
        if old == self._known and len(messages) > len(self._known):
            return None
        i = next((i for i, (a, b) in enumerate(zip(old, self._known)) if a != b), len(old))
        return "the agent's request does not continue the conversation: " + (
            f"message {i} ({self._known[i][0]}) differs from what the model saw" if i < len(self._known)
            else "no new message after the reply")

    def _messages(self, body: dict) -> list[dict]:
        try:
            return [_render(m) for m in body["messages"]]
        except GatewayError as e:
            raise self._refuse(e.message) from None
        except (KeyError, TypeError, AttributeError) as e:  # e.g. a tool call without its function
            raise self._refuse(f"a malformed message ({type(e).__name__}: {e})") from None

    def _refuse(self, why: str) -> ValueError:
        self._why = why
        return ValueError(why)

    async def close(self) -> None:
        """Ends the episode's session: a request in wait gets an error, the key stops working, the
        agent is cancelled (a plain function's thread hears the error, and its next request fails)."""
        if self._session is not None:
            self._session.end(self._why or "the episode is over (a turn or context limit, or its deadline)")
            self._gateway.unregister(self._key)
        runner, self._runner, self._session = self._runner, None, None
        if runner is not None and not runner.done():
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    async def _run(self, gateway: Gateway, key: str, task: dict) -> None:
        session = self._session
        try:
            if self.command is not None and self.serve:
                reward = await AgentServer.shared(self.command, self.processes).run(gateway.url, key, task)
            elif self.command is not None:
                reward = await _run_command(self.command, gateway.url, key, task)
            elif inspect.iscoroutinefunction(self.run_agent) or inspect.iscoroutinefunction(
                    getattr(self.run_agent, "__call__", None)):
                http = gateway.http(via_socket=self.transport == "http", lib=httpx_of(self.client))
                if self.client == "anthropic":
                    import anthropic
                    client = anthropic.AsyncAnthropic(base_url=gateway.url.removesuffix("/v1"), api_key=key,
                                                      max_retries=0, http_client=http)
                else:
                    import openai
                    client = openai.AsyncOpenAI(base_url=gateway.url, api_key=key, max_retries=0, http_client=http)
                reward = await self.run_agent(client, task)
            else:
                reward = await _in_thread(self._run_sync, gateway.url, key, task)
            session.events.put_nowait(("end", _reward(reward)))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the agent's failure ends its episode, not the run
            session.events.put_nowait(("fail", e))

    def _run_sync(self, url: str, key: str, task: dict):
        if self.client == "anthropic":
            import anthropic
            client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=key, max_retries=0,
                                         http_client=_sync_http(httpx_of("anthropic")))
        else:
            import openai
            client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, http_client=_sync_http())
        return self.run_agent(client, task)


async def _run_command(command: list[str], url: str, key: str, task: dict) -> float:
    """The agent as a program: its own process (group), the gateway and key in the environment
    variables the OpenAI SDKs read, the task on stdin; killed with its children if the episode ends
    first. Its last line of output is the reward; a non-zero exit is the agent's failure. (Output
    goes to files: a child it leaves running cannot hold a pipe open past its end.)"""
    env = {**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": key,
           "ANTHROPIC_BASE_URL": url.removesuffix("/v1"), "ANTHROPIC_API_KEY": key}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.PIPE, stdout=out, stderr=err,
                                                    env=env, start_new_session=True)
        try:
            await proc.communicate(json.dumps(task).encode() + b"\n")
        finally:  # what it left running (or all of it, if a limit or the deadline ended the episode first)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.returncode is None:
                await proc.wait()
        out.seek(0)
        err.seek(0)
        lines, tail = out.read().decode(errors="replace").strip().splitlines(), err.read()[-800:]
    if proc.returncode != 0:
        raise RuntimeError(f"the agent command {command[0]!r} exited with status {proc.returncode}: "
                           f"{tail.decode(errors='replace').strip()}")
    try:
        return float(lines[-1])
    except (IndexError, ValueError):
        raise TypeError("the agent command must print its reward (a number) as its last line, got "
                        f"{(lines or [''])[-1][:200]!r}") from None


_SYNC_HTTP: dict = {}  # httpx package -> its client


def _sync_http(lib=None):
    """The connection pool plain-function agents' clients share (see Gateway.http), of `lib` (an
    httpx package; default httpx)."""
    if lib is None:
        import httpx as lib
    if lib.__name__ not in _SYNC_HTTP:
        _SYNC_HTTP[lib.__name__] = pooled(lib.Client, lib)
    return _SYNC_HTTP[lib.__name__]


class _Schema:
    def __init__(self, schema: dict) -> None:
        self.schema = schema


def _reward(x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"the agent must return its reward as a number, got {type(x).__name__}")
    return float(x)


def _ending(kind: str, value) -> str:
    return f"{type(value).__name__}: {value}" if kind == "fail" else f"returned {value}"


def _text(content) -> str:
    text = text_content(content)
    if text is None:
        raise GatewayError(400, "message content must be a string or a list of text parts")
    return text


def _render(m: dict) -> dict:
    """A request message as the chat template takes it: text content, `developer` as `system`, tool
    calls' arguments as objects."""
    out = {k: v for k, v in m.items() if v is not None and k not in ("refusal", "annotations", "audio", "function_call")}
    out["role"] = "system" if m["role"] == "developer" else m["role"]
    out["content"] = _text(m.get("content"))
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args(c["function"].get("arguments"))}}
                             for c in m["tool_calls"]]
    return out


def _args(a):
    if isinstance(a, str):
        try:
            return json.loads(a)
        except json.JSONDecodeError:
            return a
    return a


def _norm(m: dict) -> tuple:
    """What of a message the model saw: role, text, tool calls (name and arguments, not their ids)."""
    calls = tuple((c["function"]["name"], json.dumps(_args(c["function"].get("arguments")), sort_keys=True))
                  for c in m.get("tool_calls") or [])
    return m["role"], _text(m.get("content")).strip() if calls else _text(m.get("content")), calls


async def _in_thread(fn, *args):
    """`fn(*args)` in a thread of its own (not the default pool's few: every episode holds one)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(how, value) -> None:
        with contextlib.suppress(RuntimeError):  # (the loop has closed: nobody waits any more)
            loop.call_soon_threadsafe(lambda: done.done() or how(value))

    def target():
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            settle(done.set_exception, e)
        else:
            settle(done.set_result, result)
    threading.Thread(target=target, daemon=True, name="rollwise-agent").start()
    return await done
