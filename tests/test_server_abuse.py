"""`specrt serve` under abuse: huge bodies and prompts do not stall other clients, a disconnect frees
its row within a step, shutdown drains and then cuts streams with an error the openai client raises,
hostile JSON gets a JSON 400, queue admission counts free rows, slow headers and bodies are cut
off, an upload abandoned half-way logs nothing, and an API key guards /v1/*."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from _onnx_tiny import make_sharp_target, write_hf_target
from specrt.runtime.pipeline import Pipeline
from specrt.runtime.serving.batcher import Batcher, Request
from specrt.runtime.serving.loop import EngineLoop, QueueFull
from specrt.runtime.serving.server import ServeConfig, ServerThread, create_app

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.timeout(120)

SLOTS = 3


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("abuse")
    write_hf_target(root / "tiny", make_sharp_target())
    return Pipeline.from_checkpoint(root / "tiny")  # plain decoding: one token per step


@contextlib.contextmanager
def serving(pipe, step_delay: float = 0.0, slots: int = SLOTS, context: int = 96, max_queue: int = 16,
            header_timeout: float = 10.0, **config):
    """A server over its own engine; each busy step sleeps `step_delay` (streams that last a while)."""
    batcher = Batcher(pipe.engine_for(context, slots), None, eos_token_ids=pipe.config.eos_token_ids)
    step = batcher.step

    def slow_step():
        busy = step()
        if busy and step_delay:
            time.sleep(step_delay)
        return busy

    batcher.step = slow_step
    loop = EngineLoop(batcher, max_queue=max_queue).start()
    app = create_app(loop, pipe.tokenizer, ServeConfig("tiny", 16, 30.0, **config))
    http = ServerThread(app, header_timeout=header_timeout, drain_seconds=config.get("drain_seconds", 30.0)).start()
    try:
        yield {"base": f"http://127.0.0.1:{http.port}", "port": http.port, "loop": loop, "http": http,
               "capacity": batcher.capacity}
    finally:
        http.stop()
        loop.stop()


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def all_free(loop) -> bool:
    snap = loop.snapshot()
    return snap["free_slots"] == SLOTS and snap["running"] == 0 and snap["queue_depth"] == 0


def raw_exchange(port: int, head: bytes, body: bytes = b"", timeout: float = 10.0) -> tuple[int | None, dict]:
    """Send a hand-written request (the body from a second thread, as a client that does not wait);
    (status, JSON body) of the answer, (None, {}) when the server closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        if body:
            threading.Thread(target=send_quietly, args=(sock, body), daemon=True).start()
        data = b""
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(65536):
                data += chunk
    if not data:
        return None, {}
    header, _, payload = data.partition(b"\r\n\r\n")
    status = int(header.split(b" ")[1])
    return status, json.loads(payload[payload.index(b"{"):payload.rindex(b"}") + 1])


def send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the server may answer and close before taking it all
        sock.sendall(data)


def post_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
            "Connection: close\r\n\r\n").encode()


def timed_stream(client, out: dict, **kwargs) -> None:
    """Stream a completion, recording each chunk's arrival time (and any error)."""
    out["times"] = []
    try:
        for _ in client.completions.create(model="tiny", stream=True, temperature=0, **kwargs):
            out["times"].append(time.monotonic())
    except Exception as exc:  # surfaced by the test
        out["error"] = exc


def test_a_huge_prompt_beside_a_running_stream_does_not_stall_it(pipe):
    # built before the stream starts: the client's own work shares this process's GIL with the server
    huge = json.dumps({"model": "tiny", "prompt": "w5 " * (20_000_000 // 3)}).encode()
    with serving(pipe, step_delay=0.03) as s:
        client = openai.OpenAI(base_url=s["base"] + "/v1", api_key="unused", max_retries=0, timeout=60)
        got: dict = {}
        reader = threading.Thread(target=timed_stream, args=(client, got),
                                  kwargs={"prompt": "w5 w6", "max_tokens": 80, "extra_body": {"ignore_eos": True}})
        reader.start()
        wait_for(lambda: len(got.get("times", [])) >= 3, what="the stream's first chunks")
        # 20 MB of prompt, sent whole: refused from its Content-Length (or the connection is closed
        # under the client still sending it), never read into memory or tokenized
        status, answer = raw_exchange(s["port"], post_head("/v1/completions", len(huge)), huge, timeout=60)
        assert status in (413, None), answer
        # under the byte limit but far past the context: refused from the tokens of its head
        long = {"model": "tiny", "prompt": "w5 " * 20_000}
        with pytest.raises(openai.BadRequestError, match="more than"):
            client.completions.create(**long, max_tokens=2)
        reader.join(60)
        assert "error" not in got and len(got["times"]) >= 40
        gaps = [b - a for a, b in zip(got["times"], got["times"][1:])]
        assert max(gaps) < 1.0, f"the stream stalled {max(gaps):.2f}s"
        wait_for(lambda: all_free(s["loop"]), what="free rows")


def test_bodies_past_the_limit_are_refused_before_they_are_read(pipe):
    with serving(pipe, max_request_bytes=4096) as s:
        # the header alone decides: nothing of the 50 MB is sent
        status, answer = raw_exchange(s["port"], post_head("/v1/chat/completions", 50_000_000))
        assert status == 413 and "4096 bytes" in answer["error"]["message"]
        # a chunked upload has no length to check up front: counted as it arrives
        chunk = b"x" * 3000
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
        status, answer = raw_exchange(s["port"], head, body)
        assert status == 413 and answer["error"]["code"] == "request_too_large"
        assert all_free(s["loop"])


def test_a_non_streaming_client_that_disconnects_frees_its_row_within_one_step(pipe):
    """The row is busy (a token every step), so the disconnect must be noticed without idle time."""
    with serving(pipe, step_delay=0.05) as s:
        loop = s["loop"]
        body = json.dumps({"model": "tiny", "prompt": "w5 w6", "max_tokens": 80, "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", s["port"]), timeout=10)
        sock.sendall(post_head("/v1/completions", len(body)) + body)
        req = wait_for(lambda: next(iter(loop.batcher.running.values()), None), what="the request to start")
        wait_for(lambda: len(req.tokens) >= 5, what="a few tokens")
        at_close = len(req.tokens)
        sock.close()
        wait_for(lambda: req.done, timeout=5, what="the cancellation")
        assert req.finish_reason == "cancelled"
        # the step running at the disconnect may finish (one token); the next one frees the row
        assert len(req.tokens) - at_close <= 2, f"{len(req.tokens) - at_close} tokens after the disconnect"
        wait_for(lambda: all_free(loop), what="free rows")


def test_shutdown_lets_requests_finish_then_cuts_streams_with_an_error(pipe):
    with serving(pipe, step_delay=0.05, drain_seconds=2.0) as s:
        client = openai.OpenAI(base_url=s["base"] + "/v1", api_key="unused", max_retries=0, timeout=60)
        long_stream: dict = {}
        reader = threading.Thread(target=timed_stream, args=(client, long_stream),
                                  kwargs={"prompt": "w5 w6", "max_tokens": 120, "extra_body": {"ignore_eos": True}})
        short: dict = {}

        def short_request():
            short["answer"] = client.completions.create(model="tiny", prompt="w7", max_tokens=8, temperature=0,
                                                        extra_body={"ignore_eos": True})

        reader.start()
        wait_for(lambda: len(long_stream.get("times", [])) >= 3 or long_stream.get("error"), what="the first chunks")
        assert "error" not in long_stream, long_stream
        finisher = threading.Thread(target=short_request)
        finisher.start()
        wait_for(lambda: s["loop"].snapshot()["running"] == 2, what="both requests running")
        stopper = threading.Thread(target=s["http"].stop)  # what SIGTERM does in `specrt serve`
        began = time.monotonic()
        stopper.start()
        finisher.join(20)
        reader.join(20)
        stopper.join(20)
        # the short request finished inside the drain; the long stream was cut with an error event
        assert short["answer"].usage.completion_tokens == 8
        assert isinstance(long_stream.get("error"), openai.APIError), long_stream
        assert "shut down" in str(long_stream["error"])
        assert 1.9 < time.monotonic() - began < 10
        wait_for(lambda: all_free(s["loop"]), what="free rows")
        with pytest.raises(OSError):  # the listener is closed
            socket.create_connection(("127.0.0.1", s["port"]), timeout=2).close()


BAD_JSON = [
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_unicode"),
    (b'{"model": "tiny", "prompt": "w5 \\udfff w6"}', "invalid_unicode"),
    (b'{"model": "\\ud800", "prompt": "w5"}', "invalid_unicode"),
    (b'{"model": "tiny", "prompt": "w5", "stop": ["\\ud83d"]}', "invalid_unicode"),
    (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
    (b'{"model": "tiny", "prompt": "w5", "x": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001, "invalid_json"),
    (b'{"model": "tiny", "prompt": "w5\xff"}', "invalid_json"),
]


def test_hostile_json_gets_a_json_400(pipe):
    with serving(pipe, max_request_bytes=1_000_000) as s:
        for raw, code in BAD_JSON:
            path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
            status, answer = raw_exchange(s["port"], post_head(path, len(raw)), raw)
            assert (status, answer["error"]["code"]) == (400, code), raw[:60]
        assert all_free(s["loop"])


def test_queue_admission_counts_free_rows(pipe):
    """--max-queue bounds requests that must wait: a burst fills the free rows first."""
    batcher = Batcher(pipe.engine_for(32, SLOTS), None)
    loop = EngineLoop(batcher, max_queue=2)  # not started: nothing leaves the queue
    for _ in range(SLOTS + 2):  # 3 go to free rows at the next step, 2 wait
        loop.submit(Request([5], 2))
    assert loop.waiting_for_row() == 2
    with pytest.raises(QueueFull):
        loop.submit(Request([5], 2))
    cancelled = loop._inbox[0]
    loop.cancel(cancelled)  # a cancelled request frees its place in the queue at once
    loop.submit(Request([5], 2))
    assert loop.snapshot()["requests_rejected"] == 1


def test_slow_headers_and_a_lying_content_length_are_cut_off(pipe):
    with serving(pipe, header_timeout=0.5, read_timeout=0.5) as s:
        began = time.monotonic()
        with socket.create_connection(("127.0.0.1", s["port"]), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
            assert sock.recv(100) == b""  # closed by the server
        assert time.monotonic() - began < 5
        with socket.create_connection(("127.0.0.1", s["port"]), timeout=10) as sock:
            assert sock.recv(100) == b""  # a connection that sends nothing is closed too
        began = time.monotonic()
        status, answer = raw_exchange(s["port"], post_head("/v1/completions", 100), b'{"model": "tiny"')
        assert status == 408 and answer["error"]["code"] == "request_timeout"
        assert time.monotonic() - began < 5
        assert all_free(s["loop"])


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_client_that_hangs_up_mid_upload_is_not_a_server_error(pipe):
    seen = Records()
    with serving(pipe) as s:  # uvicorn configures its loggers when the server is made: listen after that
        loggers = [logging.getLogger(name) for name in ("uvicorn.error", "specrt.serving")]
        for logger in loggers:
            logger.addHandler(seen)
        try:
            for _ in range(3):
                with socket.create_connection(("127.0.0.1", s["port"]), timeout=10) as sock:
                    sock.sendall(post_head("/v1/completions", 1000) + b'{"model": "tiny", "prompt": "w5')
                    time.sleep(0.2)  # the handler is reading the body
            time.sleep(0.3)
            status, _ = raw_exchange(s["port"], b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert status == 200
        finally:
            for logger in loggers:
                logger.removeHandler(seen)
    errors = [r.getMessage() for r in seen.records if r.levelno >= logging.ERROR]
    assert not errors, errors


def test_an_api_key_guards_the_api(pipe):
    with serving(pipe, api_key="s3cret") as s:
        wrong = openai.OpenAI(base_url=s["base"] + "/v1", api_key="guess", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            wrong.completions.create(model="tiny", prompt="w5", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=s["base"] + "/v1", api_key="s3cret", max_retries=0, timeout=30)
        assert right.completions.create(model="tiny", prompt="w5", max_tokens=2).usage.completion_tokens == 2
        with urllib.request.urlopen(s["base"] + "/health", timeout=10) as r:  # load balancers need no key
            assert r.status == 200
        for path in ("/metrics", "/docs", "/openapi.json"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(s["base"] + path, timeout=10)
            assert err.value.code in (401, 404)
        assert all_free(s["loop"])
