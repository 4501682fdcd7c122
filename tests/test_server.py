"""`specrt serve`'s HTTP API driven by the official `openai` client: completions and chat, streaming
and not, concurrent clients (greedy output = plain decoding alone), a client that disconnects
mid-stream (its row comes back), malformed requests (4xx JSON), a full queue (429), timeouts (504)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from _onnx_tiny import make_drafters, make_sharp_target, write_hf_target
from specrt.export.checkpoints.drafters import save_drafter
from specrt.runtime.pipeline import Pipeline
from specrt.runtime.scheduler import SpsTable
from specrt.runtime.serving.batcher import Batcher, Request
from specrt.runtime.serving.loop import EngineLoop, QueueFull
from specrt.runtime.serving.server import ServeConfig, ServerThread, TextTracker, create_app

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.timeout(120)

SLOTS = 3
CAPACITY = 96
SPS = SpsTable(list(range(1, 129)), [1.0 / (1.0 + 0.03 * b) for b in range(1, 129)])


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    target = make_sharp_target()
    write_hf_target(root / "tiny", target)
    save_drafter(make_drafters(target)["dspark"], root / "ckpt", dtype=torch.float32)
    served = Pipeline.from_checkpoint(root / "tiny", drafter="dspark", drafter_ckpt=root / "ckpt")
    # the reference decodes with its own copy of the weights: a model's tap setting is shared state
    served.reference = Pipeline.from_checkpoint(root / "tiny")
    return served


@pytest.fixture(scope="module")
def server(pipe):
    engine = pipe.engine_for(CAPACITY - 64, SLOTS)  # engine_for adds a 64-slot margin
    batcher = Batcher(engine, pipe.proposer, "confidence", SPS, pipe.config.eos_token_ids)
    loop = EngineLoop(batcher, max_queue=16).start()
    http = ServerThread(create_app(loop, pipe.tokenizer, ServeConfig("tiny", 16, 30.0))).start()
    yield {"loop": loop, "base": f"http://127.0.0.1:{http.port}", "capacity": batcher.capacity}
    http.stop()
    loop.stop()
    assert not loop.alive


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0, timeout=30)


def plain_text(pipe, prompt_ids, n):
    """What plain decoding of the prompt alone gives (fresh pipeline: nothing shared with the server)."""
    return pipe.tokenizer.decode(pipe.reference.generate_ids([prompt_ids], n).tokens[0])


def wait_all_free(server, timeout=10.0):
    loop = server["loop"]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        snap = loop.snapshot()
        if snap["free_slots"] == SLOTS and snap["running"] == 0 and snap["queue_depth"] == 0:
            return snap
        time.sleep(0.05)
    raise AssertionError(f"rows did not come back: {loop.snapshot()}")


def http(server, method, path, body=None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(server["base"] + path, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_health_and_metrics(server, client):
    assert sorted(m.id for m in client.models.list().data) == ["default", "tiny"]
    status, health = http(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["slots"] == SLOTS
    status, metrics = http(server, "GET", "/metrics")
    assert status == 200 and {"tau", "tokens_per_second", "queue_depth", "free_slots"} <= set(metrics)
    with urllib.request.urlopen(server["base"] + "/metrics?format=prometheus", timeout=10) as r:
        text = r.read().decode()
    assert "specrt_queue_depth 0" in text and "specrt_tau " in text


def test_completion_greedy_equals_plain_decoding(pipe, server, client):
    r = client.completions.create(model="tiny", prompt="w5 w9 w23 w7", max_tokens=20, temperature=0)
    assert r.choices[0].text == plain_text(pipe, [5, 9, 23, 7], 20)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20 and r.usage.prompt_tokens == 4
    ids = client.completions.create(model="default", prompt=[5, 9, 23, 7], max_tokens=20, temperature=0)
    assert ids.choices[0].text == r.choices[0].text
    metrics = server["loop"].snapshot()
    assert metrics["steps"] > 0 and metrics["draft_steps"] > 0
    # the measured gate reports what it saw at one running request (its warm-up ran both kinds)
    assert set(metrics["measured_tok_s"]["1"]) == {"speculative_tok_s", "plain_tok_s"}


def test_chat_streaming_equals_non_streaming(pipe, server, client):
    messages = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w11 w12 w13"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=15, temperature=0)
    ids = pipe.tokenizer.encode(pipe.tokenizer.render_chat(messages))
    assert whole.choices[0].message.content == plain_text(pipe, ids, 15)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=15, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 15 and not chunks[-1].choices
    streamed = client.completions.create(model="tiny", prompt="w5 w9", max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == plain_text(pipe, [5, 9], 12)


def test_concurrent_clients_each_get_their_own_output(pipe, server, client):
    prompts = [[5, 9, 23], [3, 44, 12, 60, 8], [17], [40, 41], [9, 9, 9, 9], [21, 22, 23], [30]]
    expected = [plain_text(pipe, p, 30 + i) for i, p in enumerate(prompts)]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            text = " ".join(f"w{t}" for t in prompts[i])
            if i % 2:
                s = client.completions.create(model="tiny", prompt=text, max_tokens=30 + i, temperature=0, stream=True)
                got[i] = "".join(c.choices[0].text for c in s)
            else:
                got[i] = client.completions.create(model="tiny", prompt=text, max_tokens=30 + i,
                                                   temperature=0).choices[0].text
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]  # 7 clients, 3 rows
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [got[i] for i in range(len(prompts))] == expected
    snap = wait_all_free(server)
    assert snap["peak_running"] >= 2  # requests really shared steps


def test_a_client_that_disconnects_mid_stream_frees_its_row(server, client):
    before = server["loop"].snapshot()["finish_reasons"].get("cancelled", 0)
    stream = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=CAPACITY - 4, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    seen = 0
    for chunk in stream:
        seen += 1
        if seen == 3:
            break
    stream.close()  # drops the connection
    snap = wait_all_free(server)
    assert snap["finish_reasons"].get("cancelled", 0) == before + 1
    r = client.completions.create(model="tiny", prompt="w5", max_tokens=3, temperature=0)  # still serving
    assert r.usage.completion_tokens == 3


def test_stop_strings_cut_the_text(pipe, server, client):
    full = plain_text(pipe, [5, 9, 23, 7], 20)
    stop = full.split(" ")[4]
    r = client.completions.create(model="tiny", prompt="w5 w9 w23 w7", max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model="tiny", prompt="w5 w9 w23 w7", max_tokens=20, temperature=0, stop=stop,
                                  stream=True)
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text
    wait_all_free(server)


def test_sampling_with_a_seed_is_reproducible_alone_and_batched(server, client):
    """Seeded requests are Gumbel-max picks on (seed, index)-keyed noise: the same text whatever
    the drafts, the draft gate (timing-driven) and the other requests in the batch do."""
    def seeded():
        return client.completions.create(model="tiny", prompt="w5 w9", max_tokens=12, temperature=0.8, seed=3)

    a, b = seeded(), seeded()
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens >= 1
    results = []
    others = [threading.Thread(target=lambda: results.append(client.completions.create(
        model="tiny", prompt="w7 w2 w9", max_tokens=30, temperature=1.0))) for _ in range(2)]
    for t in others:
        t.start()
    c = seeded()
    for t in others:
        t.join()
    assert c.choices[0].text == a.choices[0].text and len(results) == 2
    wait_all_free(server)


BAD = [
    ("/v1/completions", {"prompt": "w5", "max_tokens": 3}, 400, "model"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "w5"}, 404, "model_not_found"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "temperature": 3.5}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "top_k": -1}, 400, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "stop": [1, 2]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 999]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": " ".join(["w5"] * 200)}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5 w6", "max_tokens": 5000}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools"),
]


@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_malformed_requests_get_clear_json_errors(server, path, body, status, words):
    got, answer = http(server, "POST", path, body)
    assert got == status
    err = answer["error"]
    assert {"message", "type", "param", "code"} <= set(err) and err["message"]
    assert words in json.dumps(err)


def test_broken_json_unknown_routes_and_the_client_view(server, client):
    status, answer = http(server, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and answer["error"]["code"] == "invalid_json"
    status, answer = http(server, "POST", "/v1/completions", raw=b"[1, 2]")
    assert status == 400 and "JSON object" in answer["error"]["message"]
    status, answer = http(server, "GET", "/v1/engines")
    assert status == 404 and "error" in answer
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="tiny", prompt="w5", top_p=1.5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "w5"}])
    wait_all_free(server)  # refused requests never took a row


@pytest.fixture()
def paused(pipe):
    """A second server over its own 1-row engine whose loop blocks inside a step until released."""
    plain = pipe.with_proposer(None)
    batcher = Batcher(plain.engine_for(32, 1), None, eos_token_ids=pipe.config.eos_token_ids)
    release = threading.Event()
    step = batcher.step

    def held_step():
        release.wait(30)
        return step()

    batcher.step = held_step
    loop = EngineLoop(batcher, max_queue=1).start()  # two requests: one for the free row, one waiting
    http_server = ServerThread(create_app(loop, pipe.tokenizer, ServeConfig("tiny", 4, 0.5))).start()
    yield {"base": f"http://127.0.0.1:{http_server.port}", "loop": loop, "release": release}
    release.set()
    http_server.stop()
    loop.stop()


def test_a_full_queue_answers_429_and_slow_requests_time_out(paused):
    client = openai.OpenAI(base_url=paused["base"] + "/v1", api_key="unused", max_retries=0, timeout=30)
    results: list = []

    def one():
        try:
            results.append(client.completions.create(model="tiny", prompt="w5", max_tokens=3, temperature=0))
        except openai.APIStatusError as exc:
            results.append(exc.status_code)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    end = time.monotonic() + 10
    while paused["loop"].queue_depth() < 2 and time.monotonic() < end:
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError, match="busy"):
        client.completions.create(model="tiny", prompt="w5", max_tokens=3)
    for t in threads:
        t.join(20)
    assert results == [504, 504]  # the engine never stepped: both hit the 0.5 s timeout
    stream = client.completions.create(model="tiny", prompt="w5", max_tokens=3, stream=True)
    events = list(stream.response.iter_lines())
    assert any("did not finish" in line for line in events)
    paused["release"].set()
    end = time.monotonic() + 10
    while paused["loop"].snapshot()["running"] + paused["loop"].queue_depth() and time.monotonic() < end:
        time.sleep(0.05)
    assert paused["loop"].snapshot()["free_slots"] == 1


def test_engine_loop_bounds_and_failures(pipe):
    plain = pipe.with_proposer(None)
    batcher = Batcher(plain.engine_for(32, 1), None)
    loop = EngineLoop(batcher, max_queue=1)  # not started: submissions stay queued
    loop.submit(Request([5], 2))  # the free row's
    loop.submit(Request([5], 2))  # waits
    with pytest.raises(QueueFull):
        loop.submit(Request([5], 2))
    assert loop.snapshot()["requests_rejected"] == 1
    step = batcher.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return step()

    batcher.step = flaky
    done = threading.Event()
    failed = Request([5, 6], 3, on_finish=lambda r: done.set())
    loop._inbox.clear()
    loop.start()
    try:
        loop.submit(failed)
        assert done.wait(10) and failed.finish_reason == "error" and "boom" in failed.error
        ok = threading.Event()
        fine = loop.submit(Request([5, 6], 3, on_finish=lambda r: ok.set()))
        assert ok.wait(10) and fine.finish_reason == "length" and loop.errors == 1 and loop.alive
    finally:
        loop.stop()


def test_text_tracker_holds_back_stop_prefixes():
    class Words:
        def decode(self, ids):
            return "".join(chr(ord("a") + i) for i in ids)

    t = TextTracker(Words(), ["cde"])
    assert t.push([0, 1]) == "ab"  # no end of "ab" starts "cde"
    assert t.push([2]) == "" and t.push([3]) == ""  # "c", "cd" might be the stop string
    assert t.push([4]) == "" and t.stopped and t.text == "ab"
    t = TextTracker(Words(), ["cde"])
    assert t.push([2, 3]) == "" and t.push([23]) == "cdx"  # a false start is released
    assert t.flush() == "" and t.text == "cdx"


def test_a_non_streaming_client_that_hangs_up_cancels_its_request(pipe, paused):
    """Non-streaming handlers poll for the disconnect; the engine here never steps, so only the
    disconnect (not completion, not the 30 s timeout) can take the request out of the queue."""
    import socket

    app = create_app(paused["loop"], pipe.tokenizer, ServeConfig("tiny", 4, 30.0))
    patient = ServerThread(app).start()
    try:
        body = json.dumps({"model": "tiny", "prompt": "w5 w6", "max_tokens": 3}).encode()
        sock = socket.create_connection(("127.0.0.1", patient.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        end = time.monotonic() + 10
        while paused["loop"].queue_depth() < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert paused["loop"].queue_depth() == 1
        sock.close()
        end = time.monotonic() + 10
        while paused["loop"].queue_depth() and time.monotonic() < end:
            time.sleep(0.02)
        assert paused["loop"].queue_depth() == 0  # cancelled; reaped at the next step
    finally:
        patient.stop()
