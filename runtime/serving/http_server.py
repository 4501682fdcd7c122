"""uvicorn, run the way `specrt serve` needs: bounded header time and a drain on shutdown.

`HttpServer` is a `uvicorn.Server` whose shutdown (SIGTERM / SIGINT in `specrt serve`, `stop()` in
`ServerThread`) first tells the app to drain (`app.state.drain.begin()`: new requests get 503,
running ones may finish until --drain-seconds, then streams still running end with an error event
the openai client raises and non-streaming ones get a 503), then lets uvicorn close the listeners
and wait for the connections. uvicorn's own graceful-shutdown timeout is set a little past the
drain as a backstop.

Header deadline: uvicorn bounds the idle time between requests of a keep-alive connection, not the
time a client may take to send a request's headers, so a client that opens connections and
trickles bytes holds them forever. The protocol below (a subclass of the protocol uvicorn would
pick) closes a connection whose request headers are not complete within `header_timeout` seconds
of its first byte (or of the connection, when nothing arrives). It reads uvicorn's `cycle`
attribute, which both of its HTTP protocols set when a request's headers are complete. The body's
time is bounded in the app (`guards.read_body`).
"""

from __future__ import annotations

import threading
import time

SHUTDOWN_MARGIN_S = 5.0  # uvicorn's backstop past the drain: the app cuts what is left at the drain deadline


def header_deadline_protocol(header_timeout: float):
    """uvicorn's HTTP protocol class with a deadline on each request's headers (module docstring)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # uvicorn without httptools: its h11 protocol
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class HeaderDeadlineProtocol(Base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:  # headers complete: a new request cycle began
                self._disarm()
            elif self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of the next request on a keep-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


def _server_class():
    import uvicorn

    class HttpServer(uvicorn.Server):
        """uvicorn.Server that drains the app before closing (module docstring)."""

        async def shutdown(self, sockets=None) -> None:
            drain = getattr(getattr(self.config.app, "state", None), "drain", None)
            if drain is not None:
                drain.begin()
            await super().shutdown(sockets)

    return HttpServer


def make_server(app, host: str = "127.0.0.1", port: int = 0, *, header_timeout: float = 10.0,
                drain_seconds: float = 30.0, log_level: str = "warning", lifespan: str = "off"):
    """An `HttpServer` for `app` (module docstring); `.run()` blocks, handling SIGTERM / SIGINT."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan=lifespan,
                            http=header_deadline_protocol(header_timeout),
                            timeout_graceful_shutdown=int(drain_seconds + SHUTDOWN_MARGIN_S))
    return _server_class()(config)


class ServerThread:
    """The server in a background thread (tests, the bench, notebooks): start() waits until it listens;
    stop() drains like a SIGTERM does."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, header_timeout: float = 10.0,
                 drain_seconds: float = 30.0) -> None:
        self.server = make_server(app, host, port, header_timeout=header_timeout, drain_seconds=drain_seconds)
        self.config = self.server.config
        self.thread = None

    def start(self, timeout: float = 20.0) -> ServerThread:
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
