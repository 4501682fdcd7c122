"""What the HTTP server checks before a request reaches the engine, and how it reads a body.

`RequestGuard` is plain ASGI middleware in front of the app. It decides from the request line and
headers alone, before one byte of the body is read:
  - API key: with `api_key` set, /v1/* and /metrics need `Authorization: Bearer KEY` (401
    otherwise; compared in constant time); /health stays open for load balancers;
  - draining: once shutdown began, new /v1/* requests get 503 (running ones finish);
  - size: a Content-Length over `max_bytes` gets 413 at once, and the connection is closed so the
    client cannot push the body anyway.
`read_body` enforces the same limit on bodies without a Content-Length (chunked uploads) and bounds
the time the whole body may take (408): a client that announces more bytes than it sends cannot
hold a handler forever. Every refusal is a JSON error in OpenAI's shape.

`json_body` parses in the caller's thread (the server runs it off the event loop) and turns
everything a hostile body can raise into a 400: invalid JSON or UTF-8, nesting deep enough to
exhaust the parser's recursion, and lone surrogates ("\\ud800" is valid JSON, but no UTF-8 text can
hold it, so tokenizing or echoing it would fail later as a 500).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from typing import Any

from specrt.runtime.serving.openai_api import ApiError

BYTES_PER_CONTEXT_TOKEN = 32  # default body limit: a generous JSON size of a prompt filling the context
BODY_OVERHEAD_BYTES = 64 * 1024  # messages, roles and options around the prompt
PROTECTED_PREFIXES = ("/v1/", "/metrics")


def default_max_request_bytes(capacity: int) -> int:
    """The body limit sized to the model's context: no valid request needs more."""
    return BODY_OVERHEAD_BYTES + BYTES_PER_CONTEXT_TOKEN * int(capacity)


def closing(exc: ApiError) -> bool:
    """Refusals after which the connection's byte stream is in an unknown state (unread body)."""
    return exc.status in (408, 413)


class RequestGuard:
    """ASGI middleware: API key, draining and Content-Length checks from the headers (module docstring)."""

    def __init__(self, app, *, max_bytes: int, api_key: str | None, draining: Callable[[], bool]) -> None:
        self.app, self.max_bytes, self.draining = app, int(max_bytes), draining
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.check(scope["path"], dict(scope.get("headers") or []))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        headers = {"Connection": "close"} if closing(refusal) else {}
        if refusal.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        await JSONResponse(refusal.body(), status_code=refusal.status, headers=headers)(scope, receive, send)

    def check(self, path: str, headers: dict[bytes, bytes]) -> ApiError | None:
        if self.api_key is not None and path.startswith(PROTECTED_PREFIXES):
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' (the server's "
                                "--api-key / SPECRT_API_KEY)", None, "invalid_api_key")
        if path.startswith("/v1/") and self.draining():
            return ApiError(503, "the server is shutting down; retry on another instance", None,
                            "server_shutting_down", "server_error")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return ApiError(400, "the Content-Length header is not a number", None, "invalid_header")
            if size > self.max_bytes:
                return too_large(self.max_bytes)
        return None


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes (sized to the "
                    "model's context: a longer prompt could not be served anyway)", None, "request_too_large")


async def read_body(request, max_bytes: int, timeout: float) -> bytes:
    """The whole body, refused past max_bytes (413) or when it takes longer than `timeout` (408).
    A client that disconnects while uploading raises starlette's ClientDisconnect (answered quietly)."""

    async def collect() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g}s (is Content-Length right?)",
                       None, "request_timeout") from None


def json_body(raw: bytes) -> Any:
    """Parsed JSON, or a 400 for anything a hostile body can raise (module docstring)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, "the request body is not valid JSON (or is nested too deeply)", None,
                       "invalid_json") from None
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the request has a string with a lone surrogate (e.g. \"\\ud800\"), which is not text",
                       None, "invalid_unicode") from None
    except RecursionError:  # pragma: no cover - loads accepted it, so dumps reaches the same depth
        raise ApiError(400, "the request body is nested too deeply", None, "invalid_json") from None
    return body
