"""The engine thread: one background thread owns the `Batcher`; callers submit and cancel.

Threads: HTTP handlers (or bench clients) call `submit` / `cancel` / `snapshot` from any thread.
They never touch the engine: `submit` appends to an inbox under a lock and wakes the engine
thread, which moves the inbox into the batcher between steps. A step never waits for a client:
token callbacks run on the engine thread and must only hand the tokens over (the server's do a
`call_soon_threadsafe` into its event loop).

Bounded queue: `max_queue` caps the requests that must wait for a row, that is the requests not
yet on a row (inbox + batcher queue) beyond the free rows the next step admits them to; `submit`
raises `QueueFull` past it (HTTP 429). Counting free rows matters: the inbox fills during a step,
and a burst must not be refused while rows stand idle. Cancellation sets a flag the next step
reads; the row is freed there. An exception inside a step is a bug: it is logged, every request in
flight finishes with finish_reason "error", the engine is reset, and the loop keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from specrt.runtime.serving.batcher import Batcher, Request

log = logging.getLogger("specrt.serving")


class QueueFull(Exception):
    pass


class EngineLoop:
    def __init__(self, batcher: Batcher, max_queue: int = 64, window_seconds: float = 30.0) -> None:
        self.batcher = batcher
        self.max_queue = int(max_queue)
        self.window = float(window_seconds)
        self._cond = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.errors = 0
        self.started_at = time.time()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens emitted) per busy step
        self.total_requests = 0
        self.rejected = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> EngineLoop:
        self._thread = threading.Thread(target=self._run, name="specrt-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---------------------------------------------------------------- client side
    def submit(self, req: Request) -> Request:
        """Queue a request (validated here, in the caller's thread: SpecrtError for bad input)."""
        self.batcher.validate(req)
        with self._cond:
            if self.waiting_for_row() >= self.max_queue:
                self.rejected += 1
                raise QueueFull(f"{self.max_queue} requests are already waiting for a row")
            self._inbox.append(req)
            self.total_requests += 1
            self._cond.notify_all()
        return req

    def cancel(self, req: Request) -> None:
        with self._cond:
            req.cancelled = True
            self._cond.notify_all()

    def queue_depth(self) -> int:
        """Requests waiting for a row; cancelled ones (reaped at the next step) do not count."""
        waiting = list(self._inbox) + list(self.batcher.waiting)  # list(): one C-level copy under the GIL
        return sum(not r.cancelled for r in waiting)

    def waiting_for_row(self) -> int:
        """Requests not yet on a row that the free rows cannot take at the next step (what --max-queue bounds)."""
        return max(self.queue_depth() - self.batcher.free_rows, 0)

    def snapshot(self) -> dict:
        """Numbers for /metrics and /health (read without stopping the engine: approximate)."""
        b, c = self.batcher, self.batcher.counters
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= self.window]
        span = (now - recent[0][0]) if len(recent) > 1 else 0.0
        return {
            "slots": b.slots,
            "free_slots": b.free_rows,
            "running": len(b.running),
            "peak_running": c.peak_running,
            "queue_depth": self.queue_depth(),
            "waiting_for_row": self.waiting_for_row(),
            "max_queue": self.max_queue,
            "requests_total": self.total_requests,
            "requests_finished": c.finished,
            "requests_rejected": self.rejected,
            "finish_reasons": dict(c.finish_reasons),
            "engine_errors": self.errors,
            "steps": c.steps,
            "draft_steps": c.draft_steps,
            "prefill_tokens": c.prefill_tokens,
            "generated_tokens": c.generated,
            "tau": c.emitted / c.row_steps if c.row_steps else 1.0,
            "acceptance": c.accepted_drafts / c.verify_drafts if c.verify_drafts else 0.0,
            "tokens_per_second": sum(n for _, n in recent[1:]) / span if span > 0 else 0.0,
            "busy_seconds": c.busy_seconds,
            "uptime_seconds": time.time() - self.started_at,
            "schedule": b.schedule,
            "drafter": b.proposer.name if b.proposer is not None else "none",
            "draft_gate_skipped": b.gate.skipped if b.gate is not None else 0,
            "measured_plain_steps": c.measured_plain_steps,
            # tokens/s the measured gate saw, per running-request count (speculative vs plain steps)
            "measured_tok_s": {str(rows): rates for rows, rates in b.measured.summary().items()}
            if b.measured is not None else {},
        }

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        b = self.batcher
        while True:
            with self._cond:
                while not self._stop and not self._inbox and b.idle:
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    break
                while self._inbox:
                    b.waiting.append(self._inbox.popleft())
            try:
                before = b.counters.generated
                busy = b.step()
                if busy:
                    self._recent.append((time.perf_counter(), b.counters.generated - before))
                    while len(self._recent) > 4096:
                        self._recent.popleft()
            except Exception as exc:  # a bug: keep serving the others
                self.errors += 1
                log.exception("engine step failed")
                b.fail_all(f"engine error: {type(exc).__name__}: {exc}")
        b.fail_all("the server is shutting down")
