"""Tools: a name, a description, JSON-schema parameters and an async call with a deadline.

A tool failure is data for the model, never a crash: bad arguments, exceptions, timeouts and
results that are not text all come back as an error observation (`ToolResult.ok == False`); only
a `ServiceError` (the service behind the tool is down) ends the episode, as an error, to be retried.
Synchronous functions run in a worker thread so they never block the event loop. A tool may carry
a simulated latency (to model slow APIs in benchmarks).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import random
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", list: "array"}


@dataclass(slots=True)
class ToolResult:
    name: str
    content: str
    ok: bool = True
    seconds: float = 0.0


@dataclass(slots=True)
class Latency:
    """Simulated latency: uniform in [lo, hi] seconds, or log-normal with that median and spread
    (a heavy tail, like real APIs), capped at `cap`."""

    lo: float = 0.0
    hi: float = 0.0
    kind: str = "uniform"  # uniform | lognormal
    sigma: float = 0.8
    cap: float = 5.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def sample(self) -> float:
        if self.hi <= 0:
            return 0.0
        if self.kind == "lognormal":
            return min(self.lo + self.rng.lognormvariate(0.0, self.sigma) * (self.hi - self.lo) / 2, self.cap)
        return self.rng.uniform(self.lo, self.hi)


class ToolArgumentError(ValueError):
    pass


class ToolError(RuntimeError):
    """A tool's own account of a failed call (an MCP server's error result): the model reads
    `error: <message>`, without the exception's type."""


class ServiceError(RuntimeError):
    """A tool's backing service is down (after its own retries): the episode ends with status
    `error` and runs again, rather than the model reading the outage as the tool's answer."""


class Tool:
    def __init__(self, fn: Callable, *, name: str | None = None, description: str | None = None,
                 parameters: dict | None = None, timeout: float | None = 10.0, latency: Latency | None = None,
                 pure: bool = False) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.description = description or (inspect.getdoc(fn) or "").split("\n\n")[0]
        self.parameters = parameters or schema_from_signature(fn)
        self.timeout = timeout
        self.latency = latency
        # its result depends on its arguments and the episode's task alone (no state, no side effects):
        # an env with `tool_cache` runs it once per task and arguments (ToolCache)
        self.pure = pure

    @property
    def schema(self) -> dict:
        """The OpenAI/Hermes function schema the chat template shows the model."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    async def call(self, arguments: dict | None, timeout: float | None = None) -> ToolResult:
        t0 = time.perf_counter()
        fail = lambda msg: ToolResult(self.name, f"error: {msg}", False, time.perf_counter() - t0)  # noqa: E731
        try:
            args = self._check(arguments)
        except ToolArgumentError as e:
            return fail(e)
        limit = timeout or self.timeout
        try:  # (no limit: the tool keeps its own deadline, e.g. the sandbox's, which excludes queueing)
            result = await (self._run(args) if limit is None else asyncio.wait_for(self._run(args), limit))
        except asyncio.TimeoutError:
            return fail(f"tool {self.name!r} timed out after {limit:g}s")
        except ServiceError:
            raise
        except ToolError as e:
            return fail(e)
        except Exception as e:  # noqa: BLE001 - the tool's own failure goes back to the model
            return fail(f"tool {self.name!r} failed: {type(e).__name__}: {e}")
        try:
            content = result if isinstance(result, str) else json.dumps(result)
        except (TypeError, ValueError):
            return fail(f"tool {self.name!r} returned {type(result).__name__}, which is neither text nor JSON")
        return ToolResult(self.name, content, True, time.perf_counter() - t0)

    async def _run(self, args: dict):
        if self.latency is not None:
            await asyncio.sleep(self.latency.sample())
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**args)
        return await asyncio.to_thread(self.fn, **args)

    def _check(self, arguments) -> dict:
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"arguments of {self.name!r} must be a JSON object, got {type(arguments).__name__}")
        props = self.parameters.get("properties", {})
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            raise ToolArgumentError(f"unknown arguments {unknown} for {self.name!r}; expected {sorted(props)}")
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            raise ToolArgumentError(f"missing arguments {missing} for {self.name!r}")
        for k, v in arguments.items():
            want = props[k].get("type")
            if want and not _is_type(v, want):
                raise ToolArgumentError(f"argument {k!r} of {self.name!r} must be {want}, got {type(v).__name__}")
        return arguments


class ToolCache:
    """Results of pure tools' calls in a run (one event loop), by task, tool and arguments, as
    TVCache reuses tool results across a GRPO group's samples: a call asked again while the first
    is out joins it, and one asked after it ended takes its result if `keep` says so (by default a
    successful ToolResult). Least recently used entries go past `size` (0: calls are only joined)."""

    def __init__(self, size: int = 65536, keep: Callable = lambda result: result.ok) -> None:
        from collections import OrderedDict
        self.size, self.keep, self.done, self.out = size, keep, OrderedDict(), {}
        self.hits = self.misses = 0

    async def get(self, key, run: Callable) -> tuple[ToolResult, bool]:
        """The result for `key` (running `run()` if none is kept or out) and whether it was reused."""
        if key in self.done:
            self.done.move_to_end(key)
            self.hits += 1
            return self.done[key], True
        fut, reused = self.out.get(key), True
        if fut is None:
            fut, reused = asyncio.ensure_future(run()), False
            self.out[key] = fut
            fut.add_done_callback(lambda f: self._keep(key, f))
        self.hits += reused
        self.misses += not reused
        return await asyncio.shield(fut), reused  # (a caller cut off leaves the call to the others)

    def _keep(self, key, fut: asyncio.Future) -> None:
        self.out.pop(key, None)  # (and the exception retrieved: one every caller left is not logged as lost)
        if fut.cancelled() or fut.exception() is not None or not self.size or not self.keep(fut.result()):
            return
        self.done[key] = fut.result()
        if len(self.done) > self.size:
            self.done.popitem(last=False)


def tool(fn: Callable | None = None, **kwargs):
    """Declare a tool from a typed function: `@tool` or `@tool(timeout=2.0)`."""
    if fn is None:
        return lambda f: Tool(f, **kwargs)
    return Tool(fn, **kwargs)


def schema_from_signature(fn: Callable) -> dict:
    hints = typing.get_type_hints(fn)
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        props[name] = _json_schema(hints.get(name, str))
        if p.default is inspect.Parameter.empty:
            required.append(name)
        else:
            props[name]["default"] = p.default
    return {"type": "object", "properties": props, "required": required}


def _json_schema(t) -> dict:
    origin = typing.get_origin(t)
    if origin is typing.Literal:
        vals = typing.get_args(t)
        return {"type": _JSON_TYPES.get(type(vals[0]), "string"), "enum": list(vals)}
    if origin in (list, tuple):
        args = typing.get_args(t)
        return {"type": "array", "items": _json_schema(args[0]) if args else {}}
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return _json_schema(args[0]) if len(args) == 1 else {}
    if origin is dict:
        return {"type": "object"}
    return {"type": _JSON_TYPES.get(t, "string")}


def _is_type(v, want) -> bool:
    if isinstance(want, list):  # JSON schema's ["string", "null"]
        return any(_is_type(v, w) for w in want)
    if want == "null":
        return v is None
    if want == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if want == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, {"string": str, "boolean": bool, "object": dict, "array": list}.get(want, object))
