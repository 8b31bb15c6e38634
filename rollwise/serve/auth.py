"""Who may call what on `rollwise serve` and `rollwise route`: the optional bearer API key (health
and metrics stay open), and the control endpoints, which off loopback need one, as weight updates do."""
from __future__ import annotations

import secrets

from fastapi.responses import Response
from starlette.datastructures import Headers

from rollwise.config import ServerConfig
from rollwise.serve.responses import error

OPEN_PATHS = {"/health", "/ping", "/metrics"}
# control endpoints: off loopback they need the API key, as weight updates do (pausing or aborting a
# server, flushing its cache, changing a route's replicas; vLLM serves its own only in dev mode)
CONTROL_PATHS = {"/pause", "/resume", "/reset_prefix_cache", "/flush_cache", "/pause_generation", "/abort_request",
                 "/continue_generation", "/abort_requests", "/collective_rpc", "/update_weight_version",
                 "/weight_checker", "/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
                 "/shutdown_weight_transfer_engine", "/init_weights_update_group", "/destroy_weights_update_group"}


class AuthMiddleware:
    """The optional API key and the control endpoints' rule off loopback, as plain ASGI (starlette's http
    middleware passes every request and every piece of a stream through a task and a memory stream)."""

    def __init__(self, app, cfg: ServerConfig) -> None:
        self.app, self.cfg = app, cfg

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (refused := self.refused(scope["path"], scope["method"], Headers(scope=scope))):
            return await refused(scope, receive, send)
        await self.app(scope, receive, send)

    def refused(self, path: str, method: str, headers: Headers) -> Response | None:
        cfg = self.cfg
        if (path in CONTROL_PATHS or path == "/replicas" and method != "GET") and not cfg.api_key \
                and not cfg.is_loopback:
            return error(403, f"{path} off loopback needs the server started with --api-key", "permission_error")
        if cfg.api_key and path not in OPEN_PATHS:
            got = headers.get("authorization", "")
            key = headers.get("x-api-key")  # (the anthropic SDKs' header)
            if not (secrets.compare_digest(got.encode(), f"Bearer {cfg.api_key}".encode())
                    or key is not None and secrets.compare_digest(key.encode(), cfg.api_key.encode())):
                return error(401, "missing or wrong API key", "authentication_error")
        return None
