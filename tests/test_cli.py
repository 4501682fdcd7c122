"""The console script and the package layout, as a user meets them."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_generate_streams_text_and_prints_stats():
    out = subprocess.run(
        ["specrt", "generate", "--backend", "torch", "--prompt", "What is 2+2?", "--max-new-tokens", "12"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "no text on stdout"
    assert re.search(r"^tau 1\.00 \| [\d.]+ tok/s \| \d+ tokens$", out.stderr.strip().splitlines()[-1])


def test_doctor_reports_default_model():
    out = subprocess.run([sys.executable, "-m", "specrt.runtime", "doctor"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "SmolLM2-135M-Instruct" in out.stdout.replace("\n", "").replace("│", "").replace(" ", "")
    for probe in ("torch", "onnxruntime", "TensorRT", "triton"):
        assert probe in out.stdout


def test_wheel_installs_everything_under_specrt(tmp_path):
    """Only the specrt namespace is installed: no bare `runtime` or `export` top-level modules."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    if out.returncode != 0:
        pytest.fail(out.stderr[-2000:])
    wheel = next(tmp_path.glob("specrt-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"specrt"}, tops
    for module in ("specrt/export/models/llama.py", "specrt/tools/cli.py", "specrt/plugins/__init__.py"):
        assert module in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "specrt = specrt.tools.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
