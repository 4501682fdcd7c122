"""`specrt generate` and `specrt serve` run one decoding step (`specrt.runtime.step`): the same prompt,
seed and model folder give the same text from both, with the drafter or without, alone or batched."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from _onnx_tiny import make_drafters, make_target, write_hf_target
from specrt.export.checkpoints.drafters import save_drafter
from specrt.tools.cli import main as specrt_main

pytestmark = pytest.mark.timeout(300)

PROMPT = "w5 w9 w13 w2 w7"
TOKENS = 24
SEEDS = (1, 2)
TEMPERATURE = 1.0  # spread-out distributions on a random model: another rule gives another text


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_step")
    target = make_target()
    write_hf_target(root / "tiny", target)
    save_drafter(make_drafters(target)["dspark"], root / "dspark", dtype=torch.float32)
    return {"target": root / "tiny", "drafter": root / "dspark"}


def model_flags(folders, drafter: bool) -> list[str]:
    flags = ["--backend", "torch", "--target", str(folders["target"]), "--threads", "1"]
    return flags + (["--drafter", "dspark", "--drafter-ckpt", str(folders["drafter"])] if drafter else ["--drafter", "none"])


def generate_text(folders, seed: int, drafter: bool, capsys) -> str:
    code = specrt_main(["generate", *model_flags(folders, drafter), "--prompt", PROMPT, "--no-chat-template",
                        "--max-new-tokens", str(TOKENS), "--temperature", str(TEMPERATURE), "--seed", str(seed)])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out.removesuffix("\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base: str, body: dict) -> dict:
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def served_texts(folders, seeds) -> dict[int, str]:
    """`specrt serve` with the drafter; one completion per seed, sent together (they share a batch)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specrt.tools.cli", "serve", *model_flags(folders, True),
                             "--port", str(port), "--slots", "2", "--capacity", "128"],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.3)
        answers: dict[int, dict] = {}

        def ask(seed: int) -> None:
            answers[seed] = post(base, {"model": "default", "prompt": PROMPT, "max_tokens": TOKENS,
                                        "temperature": TEMPERATURE, "seed": seed})

        clients = [threading.Thread(target=ask, args=(s,)) for s in seeds]
        for c in clients:
            c.start()
        for c in clients:
            c.join(150)
        return {s: answers[s]["choices"][0]["text"] for s in seeds}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_generate_and_serve_give_the_same_text_for_a_seed(folders, capsys):
    served = served_texts(folders, SEEDS)
    for seed in SEEDS:
        drafted = generate_text(folders, seed, True, capsys)
        plain = generate_text(folders, seed, False, capsys)
        assert drafted == served[seed], seed
        assert plain == served[seed], seed
    assert served[SEEDS[0]] != served[SEEDS[1]]  # the seed matters


def test_a_batch_row_gets_its_own_seed_and_row_0_the_given_one(folders):
    """`generate_ids` of one prompt twice with seed s: row 0 is the text of seed s alone, row 1 another."""
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams

    pipe = Pipeline.from_checkpoint(folders["target"], drafter="dspark", drafter_ckpt=folders["drafter"])
    ids = pipe.tokenizer.encode(PROMPT)
    params = SamplingParams(TEMPERATURE, seed=SEEDS[0])
    alone = pipe.generate_ids([ids], TOKENS, params).tokens[0]
    pair = pipe.generate_ids([ids, ids], TOKENS, params).tokens
    assert pair[0] == alone and pair[1] != alone
    assert pipe.generate_ids([ids], TOKENS, params, speculative=False).tokens[0] == alone
