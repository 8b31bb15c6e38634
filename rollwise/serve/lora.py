"""LoRA adapters over HTTP, as vLLM and SGLang serve them: `--lora-modules name=path` at start,
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (SGLang's `/load_lora_adapter` too) while
serving, listed in `/v1/models` with the base model as their parent. A request uses one by naming
it as its `model` (OpenAI APIs), `lora_path` (SGLang's /generate) or `sampling_params.lora`.
Loading needs the API key off loopback, as weight updates do."""
from __future__ import annotations

import dataclasses

from fastapi import FastAPI

from rollwise.config import ServerConfig
from rollwise.serve.protocol import _Strict
from rollwise.serve.responses import weights_refused


class LoadLoraRequest(_Strict):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(_Strict):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; ignored


def parse_modules(specs) -> dict[str, str]:
    """`name=path` pairs (vLLM's --lora-modules), or ValueError."""
    out = {}
    for s in specs or ():
        name, eq, path = s.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {s!r}")
        out[name] = path
    return out


def with_adapter(engine, params, model: str | None):
    """The params with `lora` set when `model` names a loaded adapter (other names: the base model)."""
    if model and params.lora is None and model in engine.engine.loras:
        return dataclasses.replace(params, lora=model)
    return params


def install_lora(app: FastAPI, engine, cfg: ServerConfig) -> None:
    async def load(body: LoadLoraRequest):
        if refused := weights_refused(cfg):
            return refused
        await engine.call(lambda: engine.engine.add_lora(body.lora_name, body.lora_path))
        return {"status": "ok", "lora_name": body.lora_name}

    async def unload(body: UnloadLoraRequest):
        if refused := weights_refused(cfg):
            return refused
        await engine.call(lambda: engine.engine.remove_lora(body.lora_name))
        return {"status": "ok", "lora_name": body.lora_name}

    for prefix in ("/v1", ""):
        app.post(f"{prefix}/load_lora_adapter")(load)
        app.post(f"{prefix}/unload_lora_adapter")(unload)
