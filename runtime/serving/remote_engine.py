"""`RemoteEngine`: what `server.create_app` needs from an `EngineLoop`, served by remote engine replicas.

The OpenAI routes of `specrt serve` (`server.create_app`) talk to an engine through five things:
`submit(req)`, `cancel(req)`, `alive`, `snapshot()`, `started_at` and `batcher.capacity`. This class
provides them over a Ray Serve `DeploymentHandle` to `ray_app.EngineReplica`, so the Ray ingress
reuses the server's request validation, tokenisation, stop strings, streaming and error shapes
unchanged; only the step "hand the token ids to the batcher" crosses the network.

Per request, `submit` starts an asyncio task that streams the job to a replica and feeds the
`Request` callbacks the server's `Job` set (tokens as they come, then the finish). The task runs on
the ingress's event loop, the same loop as the handlers, so the callbacks need no thread hop.

Faults: a replica that dies (or whose call fails) before the request produced a token is retried
on another replica (`RETRIES` times; Ray Serve's router drops the dead one once the controller
notices). After tokens went out a retry would repeat them, so the request finishes with
finish_reason "error" and a message that says what happened; the server turns that into a 500
(or an SSE error event, which the `openai` client raises as `APIError`).

Metrics: replicas report their `EngineLoop.snapshot()` with every finished request and when polled
(`POLL_S`); `snapshot()` sums the reports younger than `REPORT_TTL_S` (so a dead replica drops out)
and adds the ingress's own counters. `alive` means a replica answered within `REPORT_TTL_S`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from types import SimpleNamespace
from typing import Any

from specrt.runtime.serving.batcher import Batcher, Request
from specrt.runtime.serving.loop import QueueFull

log = logging.getLogger("specrt.serving")

RETRIES = 3  # attempts on other replicas for a request that has produced no token yet
POLL_S = 2.0
REPORT_TTL_S = 15.0
SUMMED = ("slots", "free_slots", "running", "queue_depth", "requests_finished", "generated_tokens", "steps",
          "draft_steps", "prefill_tokens", "engine_errors", "tokens_per_second")


@dataclasses.dataclass
class ReplicaShape:
    """What the ingress knows of every replica (all load the same folder with the same settings)."""

    name: str
    capacity: int
    slots: int
    engine: Any  # has .config (the target's LlamaConfig): `Batcher.validate` reads capacity and engine.config


class RemoteEngine:
    def __init__(self, handle, shape: ReplicaShape, max_queue: int) -> None:
        self.stream_handle = handle.options(stream=True)
        self.handle = handle
        self.batcher = shape  # server.create_app reads engine.batcher.capacity
        self.max_queue = int(max_queue)
        self.started_at = time.time()
        self.tasks: dict[int, asyncio.Task] = {}
        self.reports: dict[str, tuple[float, dict]] = {}  # replica id -> (monotonic time, its snapshot)
        self.counters = {"requests_total": 0, "requests_rejected": 0, "retried_requests": 0,
                         "replica_failures": 0}
        self.poller: asyncio.Task | None = None

    # ---------------------------------------------------------------- what create_app calls
    def submit(self, req: Request) -> Request:
        """Validate here (SpecrtError -> 400, as `EngineLoop.submit`), then stream it from a replica."""
        Batcher.validate(self.batcher, req)  # type: ignore[arg-type]  # reads .capacity and .engine.config
        if self.waiting() >= self.max_queue:
            self.counters["requests_rejected"] += 1
            raise QueueFull(f"{self.max_queue} requests are already waiting")
        self.counters["requests_total"] += 1
        self.tasks[req.id] = asyncio.get_running_loop().create_task(self._serve(req))
        return req

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        task = self.tasks.get(req.id)
        if task is not None and not task.done():
            task.cancel()  # the stream's cancellation reaches the replica, which frees the row

    @property
    def alive(self) -> bool:
        return bool(self._fresh_reports())

    def snapshot(self) -> dict:
        reports = self._fresh_reports()
        total: dict[str, Any] = {key: sum(r.get(key, 0) for r in reports) for key in SUMMED}
        in_flight = len(self.tasks)
        total["queue_depth"] += self.waiting()
        total.update(self.counters, replicas_reporting=len(reports), requests_in_flight=in_flight,
                     max_queue=self.max_queue, uptime_seconds=time.time() - self.started_at,
                     replicas={r["replica"]: {k: r.get(k) for k in ("slots", "free_slots", "running", "tau")}
                               for r in reports})
        return total

    # ---------------------------------------------------------------- internals
    def waiting(self) -> int:
        """Requests in flight beyond the rows the replicas report (an estimate: they wait in Ray's router)."""
        slots = sum(r.get("slots", 0) for r in self._fresh_reports())
        return max(0, len(self.tasks) - slots)

    def _fresh_reports(self) -> list[dict]:
        now = time.monotonic()
        return [r for t, r in self.reports.values() if now - t <= REPORT_TTL_S]

    def report(self, snap: dict) -> None:
        self.reports[snap["replica"]] = (time.monotonic(), snap)

    async def poll(self) -> None:
        """Keep the replicas' numbers fresh (each call lands on the replica Ray's router picks)."""
        while True:
            try:
                self.report(await asyncio.wait_for(self.handle.snapshot.remote(), POLL_S * 2))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - no replica up now: `alive` turns false as reports age
                log.debug("replica snapshot failed: %s", exc)
            await asyncio.sleep(POLL_S)

    def start_polling(self) -> None:
        self.poller = asyncio.get_running_loop().create_task(self.poll())

    async def _serve(self, req: Request) -> None:
        job = {"prompt": list(req.prompt), "max_tokens": req.max_tokens, "sampling": req.sampling,
               "stop_token_ids": tuple(req.stop_token_ids), "ignore_eos": req.ignore_eos}
        try:
            for attempt in range(RETRIES + 1):
                stream = self.stream_handle.generate.remote(job)
                try:
                    async for frame in stream:
                        if isinstance(frame, list):
                            self._tokens(req, frame)
                        else:
                            self._finish(req, frame)
                    if req.done:
                        return
                    raise RuntimeError("the replica's stream ended without a finish record")
                except asyncio.CancelledError:
                    stream.cancel()
                    raise
                except Exception as exc:  # noqa: BLE001 - any failure of the replica or of the call to it
                    if req.done:  # the finish record arrived; what failed after it costs the client nothing
                        return
                    if req.tokens or req.cancelled or attempt == RETRIES:
                        self._fail(req, exc)
                        return
                    self.counters["retried_requests"] += 1
                    log.warning("engine replica failed before the first token (%s: %s); retrying on another",
                                type(exc).__name__, exc)
                    await asyncio.sleep(0.25 * (attempt + 1))
        finally:
            self.tasks.pop(req.id, None)

    def _tokens(self, req: Request, ids: list[int]) -> None:
        if req.started_at is None:
            req.started_at = time.perf_counter()
        req.tokens.extend(ids)
        if req.on_tokens is not None:
            req.on_tokens(req, ids)

    def _finish(self, req: Request, final: dict) -> None:
        req.stats = final["stats"]
        req.error = final["error"]
        req.started_at = req.submitted_at + final["queue_seconds"]
        req.finished_at = time.perf_counter()
        self.report(final["snapshot"])
        req.finish_reason = final["finish_reason"]
        if req.on_finish is not None:
            req.on_finish(req)

    def _fail(self, req: Request, exc: Exception) -> None:
        self.counters["replica_failures"] += 1
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        req.error = (f"the engine replica serving this request failed after {len(req.tokens)} tokens "
                     f"({type(exc).__name__}: {why[:200]}); the other replicas keep serving and Ray Serve "
                     "restarts this one: retry the request")
        req.finished_at = time.perf_counter()
        req.finish_reason = "error"
        if req.on_finish is not None:
            req.on_finish(req)


def shape_from(description: dict) -> ReplicaShape:
    return ReplicaShape(description["name"], description["capacity"], description["slots"],
                        SimpleNamespace(config=description["config"]))
