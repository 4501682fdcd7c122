"""Serving specrt engines on Ray Serve: replicas of the batcher behind `specrt serve`'s OpenAI routes.

    specrt serve --engines engines/NAME --ray --replicas 2                 (local one-node cluster)
    specrt serve --engines engines/NAME --ray --autoscale 1,8 --ray-address auto   (a running cluster)

One Ray Serve application, two deployments:

  EngineReplica  N replicas (fixed, or autoscaled on ongoing requests). Each calls the loader it is
                 given (the CLI passes its own flag-driven `load_pipeline`; anything that returns a
                 `Pipeline` works), builds the batcher and runs an `EngineLoop` in its process. It
                 speaks token ids only: `generate(job)` streams lists of new ids, then one finish
                 record (finish reason, stats, its snapshot). The engine folder is read on the node the
                 replica lands on, checksums included: a folder that fails them raises `SpecrtError`
                 in the constructor, so the replica never becomes healthy and Ray reports why.
  OpenAIIngress  the HTTP routes: `server.create_app` over a `RemoteEngine` (remote_engine.py), so
                 /v1/completions, /v1/chat/completions (streaming too), /v1/models, /health and
                 /metrics validate, tokenise, stop and stream exactly as `specrt serve` does. Only
                 token ids cross to the replicas; the tokenizer travels once, from a replica, at start.

Routing. Ray Serve's default router: power of two choices over the replicas' ongoing requests.
Each engine replica takes at most `slots + CONTROL_CALLS` requests (`max_ongoing_requests`), so a
request is sent only to a replica with a free KV row (the extra call is room for a metrics poll);
the rest wait in the ingress's router and go to the first replica that frees a row. Why this and not
a custom router: speculation pays most when a replica runs few rows (verify rows are what a CPU
pays for; the scheduler and measured gate shrink drafting as rows fill), so spreading requests
evenly - fewest ongoing requests - is also what keeps each replica in its fastest regime. A custom
router that read each replica's measured tokens/s could prefer a replica whose speculation is
paying more, but every replica runs the same folder on the same kind of node, so that signal is
the occupancy the default router already uses. Autoscaling targets `slots` ongoing requests per
replica: a new replica starts when the rows of the existing ones are full.

Faults. A replica that dies mid-request: its streams end with an error event / HTTP 500 that says
the replica failed after N tokens and to retry; requests that had no token yet are retried on
another replica (`remote_engine.RETRIES`); the other replicas keep serving; Ray Serve's controller
replaces the dead replica (health checks every `HEALTH_CHECK_S`). A replica whose engine thread
stops fails `check_health` and is replaced the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from ray import serve
from specrt.plugins.errors import SpecrtError
from specrt.runtime.serving.batcher import Request
from specrt.runtime.serving.remote_engine import RemoteEngine, shape_from

APP_NAME = "specrt"
CONTROL_CALLS = 1  # room above the KV rows for a snapshot poll, so metrics never wait for a row
HEALTH_CHECK_S = 2.0
CONSTRUCTOR_RETRIES = 1  # a replica that cannot load its folder fails fast (it will not load on a retry either)
DESCRIBE_TIMEOUT_S = 600.0
QUIET = {"enable_access_log": False}  # no log line per call (a stream is one call, a metrics poll another)  # the ingress waits this long for a first engine replica to load


@dataclasses.dataclass
class ReplicaSettings:
    """How each replica sizes and schedules its batcher (the `specrt serve` flags of the same names)."""

    slots: int = 8
    capacity: int = 1024
    schedule: str = "confidence"
    sps: str | None = None  # SPS table path; default: the engine folder's sps.json
    engines: str | None = None  # the engine folder (where sps.json is looked up)
    draft_gate: bool = True
    measured_gate: bool = True
    threads: int = 1  # ONNX Runtime threads: also the CPUs Ray reserves for the replica


@dataclasses.dataclass
class IngressSettings:
    model_name: str | None = None  # default: the engine's name
    max_queue: int = 64  # requests waiting for a row across all replicas before 429
    server_options: dict = dataclasses.field(default_factory=dict)  # the other `server.ServeConfig` fields


@dataclasses.dataclass
class Scaling:
    replicas: int = 1
    autoscale: tuple[int, int] | None = None  # (min, max) replicas

    def options(self, slots: int) -> dict:
        if self.autoscale is None:
            return {"num_replicas": self.replicas}
        low, high = self.autoscale
        return {"autoscaling_config": {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": slots}}


def start_engine_loop(pipe, settings: ReplicaSettings):
    """The batcher `specrt serve` runs, in its engine thread (same helpers, same order)."""
    from specrt.runtime.serving.loading import make_batcher, make_engine, sps_for
    from specrt.runtime.serving.loop import EngineLoop

    engine = make_engine(pipe, settings.slots, settings.capacity)
    sps = sps_for(pipe, engine, settings, quiet=True)  # reads .schedule, .engines, .sps
    batcher = make_batcher(pipe, engine, settings.schedule, sps, draft_gate=settings.draft_gate,
                           measured_gate=settings.measured_gate)
    # Ray's router caps the requests a replica holds; the loop's own queue only sees that many
    return EngineLoop(batcher, max_queue=settings.slots + CONTROL_CALLS).start()


@serve.deployment
class EngineReplica:
    def __init__(self, load_pipeline: Callable[[], object], settings: ReplicaSettings) -> None:
        self.pipe = load_pipeline()  # SpecrtError (e.g. a checksum mismatch) fails the replica with its message
        self.settings = settings
        self.loop = start_engine_loop(self.pipe, settings)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def describe(self) -> dict:
        return {"name": self.pipe.name, "capacity": self.loop.batcher.capacity, "slots": self.loop.batcher.slots,
                "config": self.pipe.config, "tokenizer": self.pipe.tokenizer, "replica": self.replica_id}

    def snapshot(self) -> dict:
        return {**self.loop.snapshot(), "replica": self.replica_id}

    def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError("the engine thread stopped")

    async def generate(self, job: dict):
        """Stream one request: lists of new token ids, then a finish record (a dict)."""
        aloop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req = Request(job["prompt"], job["max_tokens"], job["sampling"], tuple(job["stop_token_ids"]),
                      job["ignore_eos"],
                      on_tokens=lambda r, ids: aloop.call_soon_threadsafe(queue.put_nowait, list(ids)),
                      on_finish=lambda r: aloop.call_soon_threadsafe(queue.put_nowait, None))
        self.loop.submit(req)
        try:
            finished = False
            while not finished:
                ids = await queue.get()
                if ids is None:
                    break
                while not queue.empty():  # one frame for what piled up meanwhile
                    more = queue.get_nowait()
                    if more is None:
                        finished = True
                        break
                    ids += more
                yield ids
            yield {"finish_reason": req.finish_reason, "error": req.error, "stats": req.stats,
                   "queue_seconds": (req.started_at or req.submitted_at) - req.submitted_at,
                   "snapshot": self.snapshot()}
        finally:  # the caller went away (client disconnect, stop string): free the row
            if not req.done:
                self.loop.cancel(req)

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    async def __init__(self, engine, settings: IngressSettings) -> None:
        description = await asyncio.wait_for(engine.describe.remote(), DESCRIBE_TIMEOUT_S)
        shape = shape_from(description)
        self.remote = RemoteEngine(engine, shape, settings.max_queue)
        self.remote.report(await engine.snapshot.remote())
        self.remote.start_polling()
        self.settings = settings
        self.tokenizer = description["tokenizer"]

    def __serve_build_asgi_app__(self):
        from specrt.runtime.serving.server import ServeConfig, create_app

        s = self.settings
        config = ServeConfig(s.model_name or self.remote.batcher.name, **s.server_options)
        return create_app(self.remote, self.tokenizer, config)


def build_app(load_pipeline: Callable[[], object], settings: ReplicaSettings, ingress: IngressSettings,
              scaling: Scaling):
    """The Ray Serve application (pass it to `serve.run`)."""
    engine = EngineReplica.options(
        max_ongoing_requests=settings.slots + CONTROL_CALLS,
        ray_actor_options={"num_cpus": settings.threads},
        health_check_period_s=HEALTH_CHECK_S,
        max_constructor_retry_count=CONSTRUCTOR_RETRIES,
        logging_config=QUIET,
        **scaling.options(settings.slots),
    )
    front = OpenAIIngress.options(
        num_replicas=1,
        max_ongoing_requests=ingress.max_queue + 4096,  # its own limit is RemoteEngine's queue (429)
        ray_actor_options={"num_cpus": 0},
        logging_config=QUIET,
    )
    return front.bind(engine.bind(load_pipeline, settings), ingress)


def deploy(app, host: str = "127.0.0.1", port: int = 8000, name: str = APP_NAME, route_prefix: str = "/") -> None:
    """Start Serve's HTTP proxy on host:port and run `app` at route_prefix; a replica that cannot start (a folder
    that fails its checksums, say) raises SpecrtError with the replica's own message."""
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(app, name=name, route_prefix=route_prefix)
    except RuntimeError as exc:
        status = serve.status().applications.get(name)
        details = [d.message for d in status.deployments.values() if d.message] if status is not None else []
        raise SpecrtError(f"the engine replicas did not start: {replica_error(chr(10).join([str(exc), *details]))}",
                          "fix the cause above (each node must see the engine folder at the same path), "
                          "or inspect the replicas with `serve status`") from None


def replica_error(message: str) -> str:
    """The user-facing line of a failed deployment's message (the SpecrtError a replica raised, if any)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        if "SpecrtError" in line:
            return line.split("SpecrtError:", 1)[-1].strip()
    return lines[-1] if lines else message


def wait_healthy(name: str = APP_NAME, timeout: float = 120.0) -> dict:
    """Block until every deployment of the app is HEALTHY; returns {deployment: running replicas}."""
    end = time.monotonic() + timeout
    while True:
        app = serve.status().applications.get(name)
        if app is not None and app.status == "RUNNING" and all(d.status == "HEALTHY" for d in app.deployments.values()):
            return {n: d.replica_states.get("RUNNING", 0) for n, d in app.deployments.items()}
        if time.monotonic() > end:
            raise SpecrtError(f"the Ray application '{name}' is not healthy after {timeout:g}s: "
                              f"{app.status if app else 'missing'}", "see `serve status` for each replica's message")
        time.sleep(0.25)
