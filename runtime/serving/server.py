"""`specrt serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `EngineLoop`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with
"stream": true, ending with `data: [DONE]`), GET /v1/models (the engine's name and `default`),
GET /health, GET /metrics (JSON; `?format=prometheus` for the text exposition format). No
/docs or /openapi.json: the API is OpenAI's.

Concurrency: the engine runs in the EngineLoop's thread; handlers are async and only submit,
await their `Job`'s queue and format text. The engine thread hands tokens over with
`call_soon_threadsafe`, so it never waits for a client. Nothing slow runs on the event loop:
parsing the body and tokenizing the prompt run in a small thread pool (HF tokenizers' batch call,
which releases the GIL), and a prompt text far longer than the context is refused from the
tokens of its head, before the whole of it is tokenized. Detokenisation and stop strings are done
in the handler; a stop string cancels the request, which frees its row at the next step.

Abuse bounds (`guards`, `http_server`): an optional API key on /v1/* and /metrics; a body limit
sized to the context (413 before the body is read); a deadline on each request's headers and on
its body (408); a task per request that waits for the client's disconnect and cancels the request
at once, so the next step frees its row, streaming or not, busy or idle.

Graceful shutdown (`Drain`): on SIGTERM new requests get 503, running ones may finish until the
drain deadline, then each stream still running ends with an error event (the openai client raises
it) and each non-streaming request gets a 503.

Failure modes, each a JSON error in OpenAI's shape: 400 bad fields, JSON, Unicode or a prompt too
long for the cache, 401 API key, 404 unknown model or route, 408 slow body, 413 body too large,
429 queue full, 503 engine thread gone or shutting down, 504 per-request timeout (a stream gets an
error event instead); 500 only for a server fault.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request as HttpRequest  # module level: FastAPI resolves the handlers' annotations here
from specrt.plugins.errors import SpecrtError
from specrt.runtime.serving.batcher import Request
from specrt.runtime.serving.guards import RequestGuard, closing, default_max_request_bytes, json_body, read_body
from specrt.runtime.serving.http_server import ServerThread  # noqa: F401  (tests and the bench import it here)
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
PING_S = 15.0  # a stream waiting this long for a token sends an SSE comment (keeps proxies from closing it)
CPU_WORKERS = 4  # threads that parse bodies and tokenize prompts
HEAD_CHARS_PER_TOKEN = 16  # a prompt text longer than capacity x this is first judged by its head's tokens
HEAD_MARGIN_TOKENS = 16  # cutting the head can split a word into more tokens than the whole text has


@dataclass
class ServeConfig:
    model_name: str
    default_max_tokens: int = 256
    request_timeout: float = 300.0
    max_request_bytes: int | None = None  # None: sized to the context (guards.default_max_request_bytes)
    read_timeout: float = 30.0  # seconds a request's body may take to arrive
    drain_seconds: float = 30.0  # on shutdown, how long running requests may go on
    api_key: str | None = None  # Bearer token required on /v1/* and /metrics


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
        self.disconnected = False
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

    def cut(self) -> None:
        """The drain deadline passed: the handler answers with a shutdown error; the row is freed."""
        self.queue.put_nowait(("shutdown", None))
        self.cancel()

    async def cancel_on_disconnect(self, request: HttpRequest) -> None:
        """Wait for the client to go away, then cancel at once (the next step frees the row). The body
        has been read, so the next ASGI message is the disconnect (or the end of the response)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        self.cancel()


class Drain:
    """Graceful shutdown: begin() (on the event loop, from `http_server.HttpServer.shutdown`) refuses
    new requests and cuts the ones still running after `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.draining = False
        self.jobs: set[Job] = set()

    def begin(self) -> None:
        if self.draining:
            return
        self.draining = True
        if self.jobs:
            log.warning("shutting down: %d requests may finish within %gs", len(self.jobs), self.seconds)
        asyncio.get_running_loop().call_later(self.seconds, self.cut)

    def add(self, job: Job) -> None:
        # finished jobs leave here; a stream whose client left before it started never runs its cleanup
        self.jobs = {j for j in self.jobs if not j.req.done}
        self.jobs.add(job)

    def cut(self) -> None:
        for job in list(self.jobs):
            if not job.req.done:
                job.cut()


def shutdown_error(seconds: float) -> ApiError:
    return ApiError(503, f"the server shut down; this answer was cut after the {seconds:g}s drain", None,
                    "server_shutdown", "server_error")


def create_app(engine: EngineLoop, tokenizer, config: ServeConfig):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    app = FastAPI(title="specrt", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    names = {config.model_name, "default"}
    capacity = engine.batcher.capacity
    max_bytes = config.max_request_bytes or default_max_request_bytes(capacity)
    drain = app.state.drain = Drain(config.drain_seconds)
    app.add_middleware(RequestGuard, max_bytes=max_bytes, api_key=config.api_key, draining=lambda: drain.draining)
    cpu = ThreadPoolExecutor(CPU_WORKERS, thread_name_prefix="specrt-http-cpu")

    def error(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers={"Connection": "close"} if closing(exc) else None)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_request, _exc):  # the client left while uploading: nobody to answer, nothing to log
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _server_fault(_request, exc: Exception):  # a bug: JSON like every other error (uvicorn logs it)
        return JSONResponse(ApiError(500, f"internal server error ({type(exc).__name__})", None, "internal_error",
                                     "server_error").body(), status_code=500)

    @app.get("/v1/models")
    async def models():
        created = int(engine.started_at)
        return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "specrt"}
                                           for n in (config.model_name, "default")]}

    @app.get("/health")
    async def health():
        snap = engine.snapshot()
        ok = engine.alive and not drain.draining
        status = "ok" if ok else ("shutting down" if engine.alive else "engine stopped")
        body = {"status": status, "model": config.model_name,
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

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(cpu, fn, *args)

    def encode_text(text: str) -> list[int]:
        hf = getattr(tokenizer, "tokenizer", None)
        if hasattr(hf, "encode_batch"):  # HF tokenizers: the batch call releases the GIL, encode() holds it
            return hf.encode_batch([text], add_special_tokens=False)[0].ids
        return tokenizer.encode(text)

    def prompt_ids(p: ParsedRequest) -> list[int]:
        """The prompt's ids (runs in the CPU pool); a text far past the context is refused from its head."""
        if p.prompt_ids is not None:
            return list(p.prompt_ids)
        where = "messages" if p.chat else "prompt"
        try:
            text = tokenizer.render_chat(p.messages) if p.chat else p.prompt_text
        except SpecrtError as exc:
            raise ApiError(400, exc.problem, where, "invalid_value") from None
        head_chars = capacity * HEAD_CHARS_PER_TOKEN
        if len(text) > head_chars and len(encode_text(text[:head_chars])) > capacity + HEAD_MARGIN_TOKENS:
            raise ApiError(400, f"the prompt has more than {capacity} tokens; this server's context holds {capacity} "
                           "(prompt + completion)", where, "context_length_exceeded")
        return encode_text(text)

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

    async def submit(p: ParsedRequest) -> Job:
        if p.model not in names:
            raise ApiError(404, f"model '{p.model}' does not exist; this server serves "
                           f"{sorted(names)}", "model", "model_not_found")
        req = make_request(p, await off_loop(prompt_ids, p))
        if not engine.alive:
            raise ApiError(503, "the engine is not running", None, "engine_stopped", "server_error")
        if drain.draining:
            raise ApiError(503, "the server is shutting down; retry on another instance", None,
                           "server_shutting_down", "server_error")
        job = Job(asyncio.get_running_loop(), engine, req)
        try:
            engine.submit(req)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy ({exc}); retry later", None, "queue_full",
                           "rate_limit_error") from None
        except SpecrtError as exc:
            raise ApiError(400, exc.problem, "prompt", "invalid_value") from None
        drain.add(job)
        return job

    def stats(req: Request) -> dict:
        s = req.stats
        return {"tau": round(s.tau, 3), "rounds": s.rounds, "finish_reason": req.finish_reason,
                "queue_seconds": round((req.started_at or req.submitted_at) - req.submitted_at, 4)}

    async def parsed(request: HttpRequest, parse) -> ParsedRequest:
        raw = await read_body(request, max_bytes, config.read_timeout)
        return parse(await off_loop(json_body, raw))

    def timeout_error() -> ApiError:
        return ApiError(504, f"the request did not finish within {config.request_timeout:g}s", None,
                        "timeout", "timeout_error")

    async def respond(request: HttpRequest, parse):
        p = await parsed(request, parse)
        job = await submit(p)
        watcher = asyncio.create_task(job.cancel_on_disconnect(request))
        rid = new_id(p.chat)
        tracker = TextTracker(tokenizer, p.stop)
        deadline = time.monotonic() + config.request_timeout
        if p.stream:
            return StreamingResponse(stream(job, watcher, rid, p, tracker, deadline), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces, finish = [], None
        try:
            while finish is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise timeout_error()
                try:
                    kind, value = await asyncio.wait_for(job.queue.get(), remaining)
                except asyncio.TimeoutError:
                    continue
                if kind == "shutdown":
                    raise shutdown_error(drain.seconds)
                if kind == "tokens":
                    pieces.append(tracker.push(value))
                    if tracker.stopped:
                        finish = "stop"
                elif value == "error":
                    raise ApiError(500, job.req.error or "engine error", None, "engine_error", "server_error")
                elif value == "cancelled" and job.disconnected:
                    return Response(status_code=499)  # nobody is listening
                else:
                    pieces.append(tracker.flush())
                    finish = FINISH.get(value, "stop")
        finally:
            finished(job, watcher)
        use = usage(len(job.req.prompt), len(job.req.tokens))
        return completion_body(rid, p.model, p.chat, "".join(pieces), finish, use, stats(job.req))

    def finished(job: Job, watcher: asyncio.Task) -> None:
        watcher.cancel()
        job.cancel()
        drain.jobs.discard(job)

    def event(body) -> str:
        return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"

    async def stream(job: Job, watcher: asyncio.Task, rid: str, p: ParsedRequest, tracker: TextTracker,
                     deadline: float):
        try:
            if p.chat:
                yield event(chunk_body(rid, p.model, True, "", None, role=True))
            finish = None
            while finish is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    yield event(timeout_error().body())
                    return
                try:
                    kind, value = await asyncio.wait_for(job.queue.get(), min(remaining, PING_S))
                except asyncio.TimeoutError:
                    yield ": ping\n\n"
                    continue
                piece = ""
                if kind == "shutdown":
                    yield event(shutdown_error(drain.seconds).body())
                    return
                if kind == "tokens":
                    piece = tracker.push(value)
                    if tracker.stopped:
                        finish = "stop"
                elif value == "error":
                    yield event(ApiError(500, job.req.error or "engine error", None, "engine_error",
                                         "server_error").body())
                    return
                elif value == "cancelled" and job.disconnected:
                    return
                else:
                    piece = tracker.flush()
                    finish = FINISH.get(value, "stop")
                if piece:
                    yield event(chunk_body(rid, p.model, p.chat, piece, None))
            yield event(chunk_body(rid, p.model, p.chat, None if p.chat else "", finish))
            if p.include_usage:
                yield event(chunk_body(rid, p.model, p.chat, None, None, empty_choices=True,
                                       use=usage(len(job.req.prompt), len(job.req.tokens))))
            yield event("[DONE]")
        finally:  # also runs when the client disconnects (the response task is cancelled)
            finished(job, watcher)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await respond(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await respond(request, parse_chat)

    return app

