"""`specrt serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `EngineLoop`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with
"stream": true, ending with `data: [DONE]`), GET /v1/models (the engine's name and `default`),
GET /health, GET /metrics (JSON; `?format=prometheus` for the text exposition format).

Concurrency: the engine runs in the EngineLoop's thread; handlers are async and only submit,
await their `Job`'s queue and format text. The engine thread hands tokens over with
`call_soon_threadsafe`, so it never waits for a client. Detokenisation and stop strings are done in
the handler (off the engine thread); a stop string cancels the request, which frees its row at the
next step.

Failure modes, each a JSON error in OpenAI's shape: 400 bad fields / prompt too long for the cache,
404 unknown model or route, 429 queue full, 503 engine thread gone, 504 per-request timeout (a
stream gets an error event instead). A client that disconnects (streaming: sse-starlette cancels
the generator; non-streaming: polled `is_disconnected`) cancels its request and frees its row.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from fastapi import Request as HttpRequest  # module level: FastAPI resolves the handlers' annotations here
from specrt.plugins.errors import SpecrtError
from specrt.runtime.serving.batcher import Request
from specrt.runtime.serving.loop import EngineLoop, QueueFull
from specrt.runtime.serving.openai_api import (
    FINISH,
    ApiError,
    ParsedRequest,
    chunk_body,
    completion_body,
    new_id,
    parse_chat,
    parse_completion,
    usage,
)

log = logging.getLogger("specrt.serving")
DISCONNECT_POLL_S = 0.25


@dataclass
class ServeConfig:
    model_name: str
    default_max_tokens: int = 256
    request_timeout: float = 300.0


class TextTracker:
    """ids -> new text pieces; holds back a possible stop-string prefix and split UTF-8 characters."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""  # text handed out so far
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        full = self.tokenizer.decode(self.ids)
        hits = [full.find(s) for s in self.stops if s in full]
        if hits:
            self.stopped = True
            return self._advance(full[: min(hits)])
        safe = full.rstrip("\ufffd")  # a split UTF-8 character waits for its next token
        held = self._stop_prefix(safe)  # the end might be the start of a stop string
        return self._advance(safe[: len(safe) - held])

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of `text` that a stop string starts with (0: none)."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._advance(self.tokenizer.decode(self.ids))

    def _advance(self, upto: str) -> str:
        if not upto.startswith(self.text) or len(upto) <= len(self.text):
            return ""
        piece = upto[len(self.text):]
        self.text = upto
        return piece


class Job:
    """One request as the handler sees it: an asyncio queue the engine thread feeds."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: EngineLoop, req: Request) -> None:
        self.aloop, self.engine, self.req = loop, engine, req
        self.queue: asyncio.Queue = asyncio.Queue()
        req.on_tokens = lambda r, toks: self._put(("tokens", list(toks)))
        req.on_finish = lambda r: self._put(("finish", r.finish_reason))

    def _put(self, item) -> None:
        try:
            self.aloop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def cancel(self) -> None:
        if not self.req.done:
            self.engine.cancel(self.req)


def create_app(engine: EngineLoop, tokenizer, config: ServeConfig):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse
    from sse_starlette.sse import EventSourceResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="specrt", version="0.1.0")
    names = {config.model_name, "default"}
    capacity = engine.batcher.capacity

    def error(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code)

    @app.get("/v1/models")
    async def models():
        created = int(engine.started_at)
        return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "specrt"}
                                           for n in (config.model_name, "default")]}

    @app.get("/health")
    async def health():
        snap = engine.snapshot()
        ok = engine.alive
        body = {"status": "ok" if ok else "engine stopped", "model": config.model_name,
                **{k: snap[k] for k in ("slots", "free_slots", "running", "queue_depth")}}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(format: str = "json"):
        snap = engine.snapshot()
        if format == "prometheus":
            lines = []
            for key, value in snap.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    lines.append(f"specrt_{key} {value}")
            return PlainTextResponse("\n".join(lines) + "\n")
        return {"model": config.model_name, **snap}

    def encode(p: ParsedRequest) -> list[int]:
        if p.model not in names:
            raise ApiError(404, f"model '{p.model}' does not exist; this server serves "
                           f"{sorted(names)}", "model", "model_not_found")
        try:
            if p.chat:
                return tokenizer.encode(tokenizer.render_chat(p.messages))
            return list(p.prompt_ids) if p.prompt_ids is not None else tokenizer.encode(p.prompt_text)
        except SpecrtError as exc:
            raise ApiError(400, exc.problem, "messages" if p.chat else "prompt", "invalid_value") from None

    def make_request(p: ParsedRequest, ids: list[int]) -> Request:
        if len(ids) >= capacity:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context holds {capacity} "
                           "(prompt + completion)", "messages" if p.chat else "prompt", "context_length_exceeded")
        room = capacity - len(ids)
        if p.max_tokens is not None and p.max_tokens > room:
            raise ApiError(400, f"this server's context holds {capacity} tokens; you asked for {len(ids) + p.max_tokens} "
                           f"({len(ids)} in the prompt, {p.max_tokens} to generate): lower max_tokens to <= {room}",
                           "max_tokens", "context_length_exceeded")
        max_tokens = p.max_tokens if p.max_tokens is not None else min(config.default_max_tokens, room)
        return Request(prompt=ids, max_tokens=max_tokens, sampling=p.sampling, ignore_eos=p.ignore_eos)

    def submit(p: ParsedRequest) -> Job:
        ids = encode(p)
        req = make_request(p, ids)
        if not engine.alive:
            raise ApiError(503, "the engine is not running", None, "engine_stopped", "server_error")
        job = Job(asyncio.get_running_loop(), engine, req)
        try:
            engine.submit(req)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy ({exc}); retry later", None, "queue_full",
                           "rate_limit_error") from None
        except SpecrtError as exc:
            raise ApiError(400, exc.problem, "prompt", "invalid_value") from None
        return job

    def stats(req: Request) -> dict:
        s = req.stats
        return {"tau": round(s.tau, 3), "rounds": s.rounds, "finish_reason": req.finish_reason,
                "queue_seconds": round((req.started_at or req.submitted_at) - req.submitted_at, 4)}

    async def body_of(request: HttpRequest):
        try:
            return await request.json()
        except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ApiError(400, "the request body is not valid JSON", None, "invalid_json") from None

    async def respond(request: HttpRequest, p: ParsedRequest):
        job = submit(p)
        rid = new_id(p.chat)
        tracker = TextTracker(tokenizer, p.stop)
        deadline = time.monotonic() + config.request_timeout
        if p.stream:
            return EventSourceResponse(stream(job, rid, p, tracker, deadline), ping=15)
        pieces, finish = [], None
        try:
            while finish is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ApiError(504, f"the request did not finish within {config.request_timeout:g}s", None,
                                   "timeout", "timeout_error")
                try:
                    kind, value = await asyncio.wait_for(job.queue.get(), min(DISCONNECT_POLL_S, remaining))
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    continue
                if kind == "tokens":
                    pieces.append(tracker.push(value))
                    if tracker.stopped:
                        finish = "stop"
                elif value == "error":
                    raise ApiError(500, job.req.error or "engine error", None, "engine_error", "server_error")
                else:
                    pieces.append(tracker.flush())
                    finish = FINISH.get(value, "stop")
        finally:
            job.cancel()
        use = usage(len(job.req.prompt), len(job.req.tokens))
        return completion_body(rid, p.model, p.chat, "".join(pieces), finish, use, stats(job.req))

    async def stream(job: Job, rid: str, p: ParsedRequest, tracker: TextTracker, deadline: float):
        try:
            if p.chat:
                yield json.dumps(chunk_body(rid, p.model, True, "", None, role=True))
            finish = None
            while finish is None:
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    kind, value = await asyncio.wait_for(job.queue.get(), remaining)
                except asyncio.TimeoutError:
                    err = ApiError(504, f"the request did not finish within {config.request_timeout:g}s", None,
                                   "timeout", "timeout_error")
                    yield json.dumps(err.body())
                    return
                if kind == "tokens":
                    piece = tracker.push(value)
                    if tracker.stopped:
                        finish = "stop"
                elif value == "error":
                    yield json.dumps(ApiError(500, job.req.error or "engine error", None, "engine_error",
                                              "server_error").body())
                    return
                else:
                    piece = tracker.flush()
                    finish = FINISH.get(value, "stop")
                if piece:
                    yield json.dumps(chunk_body(rid, p.model, p.chat, piece, None))
            yield json.dumps(chunk_body(rid, p.model, p.chat, None if p.chat else "", finish))
            if p.include_usage:
                yield json.dumps(chunk_body(rid, p.model, p.chat, None, None, empty_choices=True,
                                            use=usage(len(job.req.prompt), len(job.req.tokens))))
            yield "[DONE]"
        finally:  # also runs when the client disconnects (the task is cancelled)
            job.cancel()

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await respond(request, parse_completion(await body_of(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await respond(request, parse_chat(await body_of(request)))

    return app


class ServerThread:
    """uvicorn in a background thread (tests, the bench, notebooks): start() waits until it listens."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(self.config)
        self.thread = None

    def start(self, timeout: float = 20.0) -> ServerThread:
        import threading

        self.thread = threading.Thread(target=self.server.run, name="specrt-http", daemon=True)
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        for server in self.server.servers:
            for sock in server.sockets:
                return sock.getsockname()[1]
        raise RuntimeError("the HTTP server has no socket")

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
