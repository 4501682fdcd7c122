"""Serving on ONNX Runtime tiny engines: batched greedy output equals each request alone, `specrt
calibrate` writes sps.json next to the manifest (checksums intact), the serving bench produces its
table and plot, and `specrt serve --engines` answers over HTTP."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from _onnx_tiny import make_drafters, make_sharp_target, write_hf_target
from specrt.export.checkpoints.drafters import save_drafter
from specrt.tools.cli_export import main as export_main
from specrt.tools.cli import main as cli_main
from specrt.runtime.pipeline import Pipeline
from specrt.runtime.scheduler import SpsTable
from specrt.runtime.serving.batcher import Batcher, Request

pytest.importorskip("onnxruntime")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)
pytestmark = pytest.mark.timeout(240)

KINDS = ("dspark", "eagle3")  # DFlash runs the same block proposer as DSpark (torch: test_serving_batcher.py)
PROMPTS = [[5, 9, 23, 7], [3, 44, 12, 60, 8, 31, 2], [17], [40, 41, 42], [9, 9]]
MAX_NEW = [16, 9, 20, 1, 12]
ARRIVALS = {0: [0, 1], 1: [2], 4: [3, 4]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-ort")
    target = make_sharp_target()
    drafters = make_drafters(target)
    write_hf_target(root / "tiny", target)
    out = {"root": root}
    for kind in KINDS:
        save_drafter(drafters[kind], root / f"ckpt-{kind}", dtype=torch.float32)
        folder = root / f"engine-{kind}"
        assert export_main(["--drafter", kind, "--target", str(root / "tiny"), "--drafter-ckpt",
                            str(root / f"ckpt-{kind}"), "--out", str(folder), "--quiet"]) == 0
        out[kind] = folder
    return out


@pytest.fixture(scope="module")
def alone(folders):
    plain = Pipeline.from_engines(folders["dspark"], drafter="none")
    return [plain.generate_ids([p], n).tokens[0] for p, n in zip(PROMPTS, MAX_NEW)]


def calibrate(folder: Path, slots: int) -> SpsTable:
    assert cli_main(["calibrate", "--engines", str(folder), "--slots", str(slots), "--context", "8",
                     "--repeats", "1", "--warmup", "0"]) == 0
    return SpsTable.load(folder / "sps.json")


@pytest.mark.parametrize("kind", KINDS)
def test_calibrate_writes_sps_next_to_the_manifest(folders, kind):
    from specrt.export.manifest import load_manifest

    from specrt.runtime.serving.loading import serving_pipeline

    table = calibrate(folders[kind], 2)
    pipe = serving_pipeline(Pipeline.from_engines(folders[kind]))  # what a server (and calibrate) drives
    assert table.min_tokens == 1 and table.max_tokens >= 2 * (pipe.proposer.max_drafts + 1)
    assert table.meta["slots"] == 2 and table.meta["backend"] == "ort" and table.meta["drafter"] == kind + "+lookup"
    assert (folders[kind] / "sps.png").stat().st_size > 1000
    load_manifest(folders[kind], verify_checksums=True)  # the manifest's checksums still hold


def test_calibration_responses_fit_a_short_context_target(folders, monkeypatch, capsys):
    """calibrate's fallback (plain greedy responses to ShareGPT prompts) sizes prompts and responses
    to the target's positions (the tiny target has 128) instead of asking for more than it has."""
    import specrt.tools.datasets as datasets
    from specrt.tools.cli_calibrate import generate_responses

    pipe = Pipeline.from_engines(folders["dspark"], drafter="none")
    positions = pipe.config.max_position_embeddings
    short = [(str(i), "tell me about the sky " * (i + 1)) for i in range(6)]
    long = [("long", "a very long question " * 200)]
    monkeypatch.setattr(datasets, "sharegpt_first_turns", lambda: long + short)
    pairs = generate_responses(pipe, 4)
    assert len(pairs) == 4
    for prompt, response in pairs:
        assert len(prompt) <= positions // 2 and 0 < len(response) <= positions // 2
    monkeypatch.setattr(datasets, "sharegpt_first_turns", lambda: long)
    assert generate_responses(pipe, 4) is None
    assert "no ShareGPT prompt fits" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["fixed", "confidence"])
@pytest.mark.parametrize("kind", KINDS)
def test_ort_batched_greedy_equals_alone(folders, alone, kind, schedule):
    pipe = Pipeline.from_engines(folders[kind])
    sps = None
    if schedule == "confidence":
        sps_file = folders[kind] / "sps.json"
        sps = SpsTable.load(sps_file) if sps_file.exists() else calibrate(folders[kind], 2)
    slots = 2
    batcher = Batcher(pipe.engine_for(64, slots), pipe.proposer, schedule, sps, pipe.config.eos_token_ids)
    requests = [Request(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    for step in range(400):
        for i in ARRIVALS.get(step, []):
            batcher.add(requests[i])
        if not batcher.step() and step > max(ARRIVALS):
            break
    assert [r.tokens for r in requests] == alone
    assert batcher.free_rows == slots and batcher.counters.draft_steps > 0


def test_calibrate_torch_backend_and_bad_flags(folders, tmp_path, capsys):
    out = tmp_path / "sps"
    assert cli_main(["calibrate", "--backend", "torch", "--target", str(folders["root"] / "tiny"), "--slots", "2",
                     "--context", "8", "--max-tokens", "8", "--repeats", "1", "--warmup", "0", "--out", str(out)]) == 0
    table = SpsTable.load(out / "sps.json")
    assert table.tokens == [1, 2, 4, 6, 8] and table.meta["backend"] == "torch"
    assert cli_main(["calibrate", "--backend", "ort"]) == 2
    assert "--engines" in capsys.readouterr().err
    assert cli_main(["serve", "--engines", str(folders["dspark"]), "--slots", "0"]) == 2
    assert "--slots" in capsys.readouterr().err
    assert cli_main(["serve", "--engines", str(folders["dspark"]), "--max-queue", "0"]) == 2
    assert cli_main(["bench-serving", "--engines", str(folders["dspark"]), "--concurrency", "1,x"]) == 2
    assert "comma list" in capsys.readouterr().err


def test_bench_serving_table_and_plot(folders, tmp_path):
    out = tmp_path / "bench"
    engines = ",".join(str(folders[k]) for k in KINDS)
    assert cli_main(["bench-serving", "--engines", engines, "--concurrency", "1,3", "--prompts", "synthetic",
                     "--prompt-len", "5", "--max-new-tokens", "10", "--requests", "4", "--repeats", "2",
                     "--out", str(out)]) == 0
    report = json.loads((out / "serving.json").read_text())
    rows = {(r["drafter"], r["mode"], r["concurrency"]): r for r in report["results"]}
    # the folders record copies from the text (export's --lookup default): every drafter serves with them
    expected = {("plain", "plain", c) for c in (1, 3)} | {(k + "+lookup", m, c) for k in KINDS
                                                          for m in ("fixed", "scheduled") for c in (1, 3)}
    assert set(rows) == expected
    for r in rows.values():
        assert r["tok_s"] > 0 and r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"] and r["same_as_plain"] == 1.0
    table = (out / "serving.md").read_text()
    assert "| dspark+lookup | scheduled | 3 |" in table and "same as plain" in table
    assert (out / "serving.png").stat().st_size > 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_specrt_serve_cli_answers_and_shuts_down(folders):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "specrt.tools.cli", "serve", "--engines", str(folders["dspark"]),
                             "--port", str(port), "--slots", "2", "--capacity", "64", "--threads", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    health = json.loads(r.read())
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.3)
        assert health["status"] == "ok" and health["slots"] == 2
        body = json.dumps({"model": "default", "prompt": [5, 9, 23, 7], "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.loads(r.read())
        plain = Pipeline.from_engines(folders["dspark"], drafter="none")
        assert answer["usage"]["completion_tokens"] == 16
        assert answer["choices"][0]["text"] == plain.tokenizer.decode(plain.generate_ids([[5, 9, 23, 7]], 16).tokens[0])
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
            ids = [m["id"] for m in json.loads(r.read())["data"]]
        assert "default" in ids and len(ids) == 2
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
