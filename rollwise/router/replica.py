"""Replicas the router sends requests to: the protocol, an in-process one (AsyncEngine) and an HTTP
one (`rollwise serve`'s token-level /generate, load read from its Prometheus /metrics)."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from rollwise.config import LOOPBACK
from rollwise.engine.isolation import StepFailed
from rollwise.types import GenerateOutput, GenerateRequest, WeightsNotHeld, tops_from_json
from rollwise.wire import AdapterWeights, decode_routing, from_npy64


@dataclass(slots=True)
class LoadSnapshot:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    tokens_per_s: float = 0.0  # recent generation throughput
    prefix_hit_rate: float = 0.0
    # cumulative work counters (for fitting step cost = a*prefill + b*decode + c*steps), when known
    busy_s: float | None = None
    prefill_tokens: float = 0.0
    decode_tokens: float = 0.0
    steps: float = 0.0
    kv_capacity_tokens: float = 0.0  # 0: unknown
    at: float = field(default_factory=time.monotonic)


class Replica(Protocol):
    name: str

    async def generate(self, request: GenerateRequest) -> GenerateOutput: ...

    async def abort(self, request_id: str) -> None: ...

    async def health(self) -> bool: ...

    async def load(self) -> LoadSnapshot: ...


class ReplicaError(RuntimeError):
    """The replica failed (down, unreachable, crashed): the request may be retried elsewhere."""


class _Throughput:
    def __init__(self) -> None:
        self.last: tuple[float, float] | None = None
        self.rate = 0.0

    def update(self, generated_total: float) -> float:
        now = time.monotonic()
        if self.last is not None and now > self.last[0]:
            inst = (generated_total - self.last[1]) / (now - self.last[0])
            self.rate = inst if self.rate == 0 else 0.7 * self.rate + 0.3 * inst
        self.last = (now, generated_total)
        return self.rate


class LocalReplica:
    """An in-process engine (anything with AsyncEngine's generate/abort/metrics)."""

    def __init__(self, name: str, engine) -> None:
        self.name, self.engine = name, engine
        self._tp = _Throughput()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        try:
            return await self.engine.generate(request)
        except (ValueError, StepFailed):  # the request's failure, not the engine's
            raise
        except RuntimeError as e:
            raise ReplicaError(f"{self.name}: {e}") from e

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """The turn as the engine steps: each piece its new tokens, the last with the metadata."""
        sent = 0
        salt = {} if request.cache_salt is None else {"cache_salt": request.cache_salt}
        try:
            async for out in self.engine.stream(request.prompt_token_ids, request.params, request.request_id,
                                                group_id=request.group_id, forced_output=request.forced_output,
                                                session=request.trajectory_id, policy_version=request.policy_version,
                                                **({"priority": request.priority} if request.priority else {}), **salt):
                yield GenerateOutput.of(out, sent)
                sent = len(out.token_ids)
        except (ValueError, StepFailed):  # the request's failure, not the engine's
            raise
        except RuntimeError as e:
            raise ReplicaError(f"{self.name}: {e}") from e

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def health(self) -> bool:
        return self.engine.is_running

    async def load(self) -> LoadSnapshot:
        m = self.engine.metrics()
        return LoadSnapshot(m["num_running"], m["num_waiting"], m["kv_usage"], self._tp.update(m["generated_tokens"]),
                            m["prefix_hit_rate"], m["step_time_s"], m["prefill_tokens"], m["decode_tokens"],
                            m["num_steps"], m.get("kv_capacity_tokens", 0.0))

    async def update_weights(self, weights: dict | str, version: int | None = None,
                             partial_rollout: bool = False) -> int:
        """New weights (tensors under Hugging Face names, or a model directory), between two steps;
        requests in flight finish under the old ones, or with `partial_rollout` continue under these."""
        return await self.engine.update_weights(weights, version, partial_rollout)

    async def sleep(self, level: int) -> bool:
        """The engine gives back its memory (sleep mode) if it is idle; whether it did."""
        eng = self.engine.engine

        def go() -> bool:  # (on the engine's thread: nothing is admitted between the check and the sleep)
            if eng.seqs:
                return False
            eng.sleep(level)
            return True
        return await self.engine.call(go)

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def add_sequence(self, token_ids: list[int], group_id: str | None, cache_salt: str | None = None) -> None:
        spec = getattr(self.engine.engine, "spec", None)
        if spec is not None:
            await self.engine.call(lambda: spec.add_sequence(token_ids, group_id, cache_salt))


PROM = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage", "vllm:gpu_cache_usage_perc": "kv_usage",
        "vllm:generation_tokens_total": "generated", "vllm:prefix_cache_queries_total": "queries",
        "vllm:prefix_cache_hits_total": "hits", "rollwise:engine_step_seconds_total": "busy",
        "rollwise:prefill_tokens_computed_total": "prefill", "rollwise:decode_tokens_computed_total": "decode",
        "rollwise:engine_steps_total": "steps", "rollwise:kv_capacity_tokens": "kv_capacity"}


WEIGHTS_VIA = ("auto", "stream", "file")
FLEET_WEIGHTS_VIA = (*WEIGHTS_VIA, "broadcast")  # a run's: every HTTP replica in one group (broadcast.py)


SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def safetensors_stream(tensors: dict, piece: int = 1 << 20):
    """`tensors` in the safetensors format (8-byte header length, JSON header padded to 8 bytes,
    then each tensor's bytes in header order) as (total length, async iterator of <= 1 MiB pieces),
    read straight from the tensors: no serialized copy of the whole model (`safetensors.save`
    makes one), and httpx sends pieces several times faster than one huge bytes object."""
    import json
    import struct

    import torch
    items = sorted(tensors.items())
    header, offset = {}, 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    async def pieces():
        yield struct.pack("<Q", len(head)) + head
        for _, t in items:
            raw = memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
            for i in range(0, len(raw), piece):
                yield bytes(raw[i:i + piece])
    return 8 + len(head) + offset, pieces()


# SamplingParams' fields an HTTP replica's /generate is sent only when they ask for something: when
# true (non-zero, non-empty), and when not None (0 and [] meaning something there)
SENT_WHEN_ON = ("logprobs", "logprob_token_ids", "logit_bias", "bad_words", "return_routed_experts",
                "routed_experts_prompt_start", "skip_reading_prefix_cache")
SENT_WHEN_GIVEN = ("prompt_logprobs", "allowed_token_ids", "structured_outputs", "thinking_token_budget",
                   "trace_decode_token_ids", "lora", "prompt_logprob_token_ids", "prompt_logprob_start",
                   "stream_interval")


class HttpReplica:
    """`rollwise serve` (or a server with the same /generate) at `url`."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0,
                 weights_via: str = "auto") -> None:
        """`weights_via`: how `update_weights` sends tensors: "stream" (the safetensors bytes in the
        request body; works across machines), "file" (written to a temporary directory the server
        reads: same host or a shared file system; ~4x faster on one host, benchmarks/weight_sync.py)
        or "auto": "file" for a server on this host's loopback, else "stream"."""
        if weights_via not in WEIGHTS_VIA:
            raise ValueError(f"weights_via must be one of {WEIGHTS_VIA}, got {weights_via!r}")
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as e:
            raise ValueError(f"replica url must be http(s)://HOST[:PORT], got {url!r}") from e
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"replica url must be http(s)://HOST[:PORT], got {url!r}")
        self.name = self.url = url.rstrip("/")
        if weights_via == "auto":
            weights_via = "file" if parsed.host in LOOPBACK else "stream"
        self.weights_via = weights_via
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout,
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self._tp = _Throughput()

    async def _post(self, path: str, **request) -> httpx.Response:
        """A POST whose transport failure is the replica's (ReplicaError)."""
        try:
            return await self.client.post(path, **request)
        except httpx.HTTPError as e:
            raise ReplicaError(f"{self.name}: {type(e).__name__}: {e}") from e

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        r = await self._post("/generate", json=self._body(request))
        self._check(r.status_code, r.text)
        return self._output(r.json())

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """The turn as the server streams it: each piece its new tokens, the last with the metadata."""
        async for c in self._events("/generate", self._body(request) | {"stream": True}):
            yield self._output(c) if c.get("finished") else GenerateOutput(
                token_ids=c["token_ids"], logprobs=c["logprobs"], finish_reason=None, request_id=c.get("request_id", ""),
                top_logprobs=tops_from_json(c.get("top_logprobs"), c.get("top_logprob_ranks")))

    def _body(self, request: GenerateRequest) -> dict:
        p = request.params
        return {"input_ids": request.prompt_token_ids, "request_id": request.request_id,
                "trajectory_id": request.trajectory_id, "group_id": request.group_id, "turn": request.turn,
                "forced_output": request.forced_output,
                **({} if request.policy_version is None else {"policy_version": request.policy_version}),
                **({"priority": request.priority} if request.priority else {}),
                **({"cache_salt": request.cache_salt} if request.cache_salt is not None else {}),
                "sampling_params": {"max_new_tokens": p.max_tokens,  # SGLang's name; `rollwise serve` takes both
                                    **{k: getattr(p, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed",
                                                                  "min_tokens", "stop", "stop_token_ids", "ignore_eos")},
                                    **p.penalties(),
                                    **{k: getattr(p, k) for k in SENT_WHEN_ON if getattr(p, k)},
                                    **{k: getattr(p, k) for k in SENT_WHEN_GIVEN if getattr(p, k) is not None},
                                    **({} if p.repetition_detection is None else {
                                        "repetition_detection": asdict(p.repetition_detection)})}}

    @staticmethod
    def _output(b: dict) -> GenerateOutput:
        return GenerateOutput(token_ids=b["token_ids"], logprobs=b["logprobs"], finish_reason=b["finish_reason"],
                              num_cached_tokens=b["num_cached_tokens"], policy_version=b["policy_version"],
                              request_id=b["request_id"], stop_reason=b.get("stop_reason"),
                              version_segments=[tuple(x) for x in b.get("version_segments", [])],
                              top_logprobs=tops_from_json(b.get("top_logprobs"), b.get("top_logprob_ranks")),
                              prompt_token_logprobs=b.get("prompt_logprobs"),
                              prompt_logprob_ranks=b.get("prompt_logprob_ranks"),
                              prompt_token_id_logprobs=None if b.get("prompt_token_id_logprobs") is None else
                              from_npy64(b["prompt_token_id_logprobs"]),
                              routed_experts=None if b.get("routed_experts") is None else decode_routing(
                                  b["routed_experts"], b["routed_experts_shape"]),
                              prompt_top_logprobs=None if b.get("prompt_top_logprobs") is None else [
                                  None if top is None else {t: lp for t, lp in top} for top in b["prompt_top_logprobs"]])

    def _check(self, status: int, text: str) -> None:
        """A 400 is the request's fault (ValueError, or WeightsNotHeld: another replica may serve it);
        "request_failed" the request's too (StepFailed: the replica serves on); any other failure the
        replica's (ReplicaError: retried elsewhere)."""
        if status == 200:
            return
        try:
            err = json.loads(text).get("error", {})
        except (ValueError, AttributeError):
            err = {}
        err = err if isinstance(err, dict) else {}
        if status == 400:
            raise (WeightsNotHeld if err.get("type") == "weights_not_held" else ValueError)(err.get("message", text[:500]))
        if err.get("type") == "request_failed":  # the request's failure: the replica serves on
            raise StepFailed(err.get("message", text[:500]))
        raise ReplicaError(f"{self.name}: HTTP {status}: {text[:200]}")

    async def _events(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST a streaming request; its server-sent events as dicts (an error event raises)."""
        try:
            async with self.client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    self._check(r.status_code, (await r.aread()).decode(errors="replace"))
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    c = json.loads(line[6:])
                    if "error" in c:
                        self._check(c["error"].get("code", 500), line[6:])
                    yield c
        except httpx.HTTPError as e:
            raise ReplicaError(f"{self.name}: {type(e).__name__}: {e}") from e

    async def abort(self, request_id: str) -> None:
        pass  # closing the connection aborts the request on `rollwise serve`

    async def update_weights(self, weights: dict | str, version: int | None = None,
                             partial_rollout: bool = False) -> int:
        """POST /update_weights: a model directory (str) by name; tensors streamed as safetensors
        bytes, or with weights_via="file" through a temporary directory the server must see."""
        import tempfile
        adapter = weights if isinstance(weights, AdapterWeights) else None
        if adapter is not None:
            weights = adapter.tensors
        if not isinstance(weights, str) and self.weights_via == "stream":
            size, body = safetensors_stream(weights)
            params = {"partial_rollout": str(partial_rollout).lower(),
                      **({} if version is None else {"policy_version": version}),
                      **({} if adapter is None else {"lora_config": json.dumps(adapter.config)})}
            return await self._post_weights(content=body, params=params, headers={
                "content-type": "application/octet-stream", "content-length": str(size)})
        with tempfile.TemporaryDirectory(prefix="rollwise-weights-") as tmp:  # (kept until the server has read it)
            if not isinstance(weights, str):
                from safetensors.torch import save_file
                name = "model" if adapter is None else "adapter_model"  # (an adapter: peft's directory)
                save_file({k: v.contiguous() for k, v in weights.items()}, f"{tmp}/{name}.safetensors")
                if adapter is not None:
                    Path(tmp, "adapter_config.json").write_text(json.dumps(adapter.config))
                weights = tmp
            return await self._post_weights(json={"model_dir": weights, "policy_version": version,
                                                  "partial_rollout": partial_rollout})

    async def _post_weights(self, **request) -> int:
        r = await self._post("/update_weights", **request)
        if r.status_code == 400:  # the weights' fault (a bad directory or file), not the replica's
            raise ValueError(f"{self.name}: weight update refused: {r.text[:300]}")
        if r.status_code != 200:
            raise ReplicaError(f"{self.name}: weight update failed: HTTP {r.status_code}: {r.text[:200]}")
        return int(r.json()["policy_version"])

    async def sleep(self, level: int) -> bool:
        """POST /sleep?level=N (sleep mode); False if the server is busy (400) or has no such endpoint."""
        r = await self._post("/sleep", params={"level": level})
        if r.status_code not in (200, 400, 404):
            raise ReplicaError(f"{self.name}: sleep failed: HTTP {r.status_code}: {r.text[:200]}")
        return r.status_code == 200

    async def wake_up(self) -> None:
        """POST /wake_up (every tag; a server awake, or without sleep mode, is left as it is)."""
        r = await self._post("/wake_up")
        if r.status_code not in (200, 404):
            raise ReplicaError(f"{self.name}: wake_up failed: HTTP {r.status_code}: {r.text[:200]}")

    async def health(self) -> bool:
        try:
            return (await self.client.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def info(self) -> dict:
        """The server's /health body (policy_version, keep_weight_versions)."""
        try:
            r = await self.client.get("/health", timeout=10.0)
        except httpx.HTTPError as e:
            raise ReplicaError(f"{self.name}: {type(e).__name__}: {e}") from e
        return r.json()

    async def load(self) -> LoadSnapshot:
        try:
            text = (await self.client.get("/metrics", timeout=2.0)).text
        except httpx.HTTPError as e:
            raise ReplicaError(f"{self.name}: {e}") from e
        v: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                key = PROM.get(name.split("{")[0])
                if key:
                    v[key] = float(value)
        q = v.get("queries", 0.0)
        return LoadSnapshot(v.get("running", 0.0), v.get("waiting", 0.0), v.get("kv_usage", 0.0),
                            self._tp.update(v.get("generated", 0.0)), v.get("hits", 0.0) / q if q else 0.0,
                            v.get("busy"), v.get("prefill", 0.0), v.get("decode", 0.0), v.get("steps", 0.0),
                            v.get("kv_capacity", 0.0))

    async def add_sequence(self, token_ids: list[int], group_id: str | None, cache_salt: str | None = None) -> None:
        body = {"token_ids": token_ids, "group_id": group_id} | ({"cache_salt": cache_salt} if cache_salt else {})
        try:
            await self.client.post("/spec/add_sequence", json=body)
        except httpx.HTTPError:
            pass  # drafting material is best effort

    async def close(self) -> None:
        await self.client.aclose()


async def gather_loads(replicas) -> dict[str, LoadSnapshot | None]:
    async def one(r):
        try:
            return await r.load()
        except Exception:  # noqa: BLE001 - a replica that cannot report counts as unknown
            return None
    snaps = await asyncio.gather(*(one(r) for r in replicas))
    return {r.name: s for r, s in zip(replicas, snaps)}
