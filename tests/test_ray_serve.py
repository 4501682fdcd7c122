"""`specrt serve --ray`'s application on a local Ray cluster: two replicas of a tiny engine behind the
OpenAI routes, driven by the official `openai` client. Concurrent streams give `specrt generate`'s
greedy text; killing a replica mid-stream gives its clients a clear error while the other replica
serves on and Ray replaces the dead one; a folder that fails its checksums never becomes healthy
and says why; the cluster leaves no process behind."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
from _onnx_tiny import TARGET_CFG, make_sharp_target, write_hf_target

ray = pytest.importorskip("ray", reason="needs Ray Serve: pip install 'specrt[ray]'")
serve = pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'specrt[ray]'")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("onnxruntime")
psutil = pytest.importorskip("psutil")  # a dependency of ray

from specrt.plugins.errors import SpecrtError
from specrt.runtime.pipeline import Pipeline
from specrt.tools.cli import main as cli_main
from specrt.tools.cli_export import main as export_main

pytestmark = pytest.mark.timeout(300)

SLOTS = 2
CAPACITY = 3000  # long streams: a replica is killed while they run (copies make them fast: keep a margin)
LONG = 2900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A target-only tiny engine with room for long generations (the replicas speculate with copies)."""
    root = tmp_path_factory.mktemp("ray")
    write_hf_target(root / "hf", make_sharp_target(dataclasses.replace(TARGET_CFG, max_position_embeddings=3072)))
    assert export_main(["--drafter", "none", "--target", str(root / "hf"), "--out", str(root / "engine"),
                        "--quiet", "--no-lookup-files"]) == 0
    return root / "engine"


def loader(folder: Path):
    return functools.partial(Pipeline.from_engines, str(folder), threads=1, drafter="lookup")


class Cluster:
    """A local Ray cluster (its own temp dir) with the specrt application at /."""

    def __init__(self, folder: Path) -> None:
        from specrt.runtime.serving import ray_app

        self.ray_app = ray_app
        self.temp = tempfile.mkdtemp(prefix="sr-", dir="/tmp")  # Ray's socket paths must stay short
        ray.init(num_cpus=4, include_dashboard=False, logging_level="warning", _temp_dir=self.temp,
                 object_store_memory=100 * 1024 * 1024, log_to_driver=False)
        self.port = free_port()
        self.processes: set[psutil.Process] = set()
        settings = ray_app.ReplicaSettings(slots=SLOTS, capacity=CAPACITY, schedule="fixed", threads=1)
        app = ray_app.build_app(loader(folder), settings, ray_app.IngressSettings(model_name="tiny"),
                                ray_app.Scaling(replicas=2))
        ray_app.deploy(app, port=self.port)
        self.remember_processes()
        self.base = f"http://127.0.0.1:{self.port}"

    def remember_processes(self) -> None:
        self.processes |= set(psutil.Process().children(recursive=True))

    def engine_replicas(self) -> list[str]:
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"])

    def shutdown(self) -> None:
        if ray.is_initialized():
            self.remember_processes()
            serve.shutdown()
            ray.shutdown()
            shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(folder):
    c = Cluster(folder)
    yield c
    c.shutdown()


@pytest.fixture()
def client(cluster):
    return openai.OpenAI(base_url=cluster.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def generate_text(capsys, folder: Path, prompt: str, n: int, chat: bool) -> str:
    """What `specrt generate` prints for the prompt (plain decoding, the same engine folder)."""
    capsys.readouterr()
    argv = ["generate", "--engines", str(folder), "--drafter", "none", "--threads", "1", "--prompt", prompt,
            "--max-new-tokens", str(n)] + ([] if chat else ["--no-chat-template"])
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def run_threads(fns) -> list:
    results: list = [None] * len(fns)

    def one(i):
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - returned to the caller
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_concurrent_streams_equal_specrt_generate(cluster, client, folder, capsys):
    prompts = ["w5 w9 w23 w7", "w3 w44 w12 w60 w8", "w17", "w40 w41", "w9 w9 w9 w9", "w21 w22 w23"]
    counts = [30, 24, 40, 18, 33, 27]
    expected = [generate_text(capsys, folder, p, n, chat=i == 0) for i, (p, n) in enumerate(zip(prompts, counts))]

    def stream(i):
        if i == 0:
            chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[0]}],
                                                    max_tokens=counts[0], temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        chunks = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=counts[i], temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks)

    got = run_threads([functools.partial(stream, i) for i in range(len(prompts))])  # 6 clients, 4 rows in all
    assert got == expected
    assert sorted(m.id for m in client.models.list().data) == ["default", "tiny"]


def test_bench_serving_measures_the_endpoint(cluster, tmp_path):
    """`specrt bench-serving --url` against the Ray application: every request answered in full."""
    import json

    assert cli_main(["bench-serving", "--url", cluster.base, "--concurrency", "1,2", "--requests", "4",
                     "--max-new-tokens", "6", "--prompts", "synthetic", "--prompt-len", "4", "--ignore-eos",
                     "--label", "ray 2x1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "http.json").read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["failed"] == 0 and row["tokens"] == 4 * 6 and row["latency_p95"] >= row["latency_p50"] > 0


def test_killing_a_replica_mid_stream(cluster, client):
    """Four long streams fill both replicas (2 rows each); one replica is killed once every stream has
    tokens: its clients get an error that says so, the others finish, new requests are served, and
    Ray brings the replica count back to two. On loaded cores a replica can finish its streams before
    the kill lands: then the replica is replaced and the scenario runs again (at most three times)."""
    for attempt in range(3):
        before = cluster.engine_replicas()
        assert len(before) == 2
        errors, finished = _kill_one_replica_mid_stream(client, before[0])
        for text in finished:
            assert len(text.split()) == LONG  # one word per token: the whole completion arrived
        # the survivor serves new requests at once (one landing on the dead replica first is retried)
        for i in range(3):
            r = client.completions.create(model="tiny", prompt="w5 w9", max_tokens=8, temperature=0)
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        _wait_for_a_new_replica(cluster, before[0])
        if errors:
            break
    assert errors and finished  # both replicas held streams, the killed one's clients were told
    for e in errors:
        assert isinstance(e, openai.APIError) and "replica" in str(e) and "retry" in str(e), repr(e)
    cluster.remember_processes()


def _kill_one_replica_mid_stream(client, replica) -> tuple[list, list]:
    """Four long streams; `replica` is killed once each has tokens: (errors, finished texts)."""
    started = threading.Barrier(5, timeout=60)

    def stream(i):
        chunks = client.completions.create(model="tiny", prompt=f"w{5 + i} w{9 + i}", max_tokens=LONG,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, first = "", True
        for c in chunks:
            text += c.choices[0].text
            if first and text:
                first = False
                started.wait()
        return text

    results: list = []
    waiter = threading.Thread(target=lambda: results.extend(run_threads([functools.partial(stream, i)
                                                                         for i in range(4)])))
    waiter.start()
    started.wait()  # every stream has its first tokens
    ray.kill(ray.get_actor(replica, namespace="serve"))
    waiter.join(120)
    assert len(results) == 4, results
    return ([r for r in results if isinstance(r, BaseException)], [r for r in results if isinstance(r, str)])


def _wait_for_a_new_replica(cluster, killed) -> None:
    """Ray replaces the killed replica: two healthy engine replicas, `killed` not among them."""
    end = time.monotonic() + 90
    while time.monotonic() < end:
        now = cluster.engine_replicas()
        if len(now) == 2 and killed not in now and cluster.ray_app.wait_healthy(timeout=90)["EngineReplica"] == 2:
            return
        time.sleep(0.5)
    raise AssertionError(f"the killed replica was not replaced: {cluster.engine_replicas()}")


def test_corrupt_folder_never_becomes_healthy(cluster, folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    graph = next(broken.glob("*.onnx.data"), None) or next(broken.glob("*.onnx"))
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    ray_app = cluster.ray_app
    app = ray_app.build_app(loader(broken), ray_app.ReplicaSettings(slots=1, capacity=64, threads=1),
                            ray_app.IngressSettings(), ray_app.Scaling(replicas=1))
    with pytest.raises(SpecrtError, match="is corrupt: sha256") as info:
        ray_app.deploy(app, port=cluster.port, name="broken", route_prefix="/broken")
    assert graph.name in str(info.value)
    cluster.remember_processes()
    serve.delete("broken")


def test_cluster_shuts_down_without_stray_processes(cluster):
    processes = set(cluster.processes)
    assert processes  # raylet, gcs, workers: children of this process
    cluster.shutdown()
    end = time.monotonic() + 30
    while time.monotonic() < end:
        alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.25)
    else:
        raise AssertionError(f"left running: {[(p.pid, p.name()) for p in alive]}")
