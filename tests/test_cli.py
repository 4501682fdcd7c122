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
    out = subprocess.run([sys.executable, "-m", "specrt.tools", "doctor"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "SmolLM2-135M-Instruct" in out.stdout.replace("\n", "").replace("│", "").replace(" ", "")
    for probe in ("torch", "onnxruntime", "TensorRT", "triton", "huge pages"):
        assert probe in out.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("wheel")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out_dir), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    if out.returncode != 0:
        pytest.fail(out.stderr[-2000:])
    return next(out_dir.glob("specrt-*.whl"))


def test_wheel_installs_everything_under_specrt(wheel):
    """Only the specrt namespace is installed: no bare `runtime` or `export` top-level modules."""
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"specrt"}, tops
    for module in ("specrt/export/models/llama.py", "specrt/tools/cli.py", "specrt/plugins/__init__.py"):
        assert module in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "specrt = specrt.tools.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.slow
def test_a_wheel_install_exports_the_same_copy_files_as_the_editable_one(wheel, tmp_path):
    """A non-editable install carries the data `specrt export` builds the copy datastore from: in a
    fresh venv holding only the wheel (dependencies shared with this environment), the shipped data
    sets are found with the same bytes, and the export step writes datastore.npz and lookup.json."""
    import hashlib

    from specrt.tools.copy_files import shipped_data_for

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    script = (
        "import hashlib, json, sys; from pathlib import Path; import specrt.tools\n"
        "from specrt.tools.cli_export import copy_files_for; from specrt.tools.copy_files import shipped_data_for\n"
        "data = shipped_data_for('SmolLM2-135M-Instruct')\n"
        "inputs = {f'{d.name}/{f.name}': hashlib.sha256(f.read_bytes()).hexdigest() for d in data for f in d.iterdir()}\n"
        "note = copy_files_for(Path(sys.argv[1]), 'SmolLM2-135M-Instruct')\n"
        "print(json.dumps({'package': specrt.tools.__file__, 'inputs': inputs, 'note': note}))\n"
    )
    folder = tmp_path / "engine"
    folder.mkdir()
    out = subprocess.run([str(python), "-c", script, str(folder)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["package"].startswith(str(venv)), report["package"]  # the wheel, not this checkout
    here = {f"{d.name}/{f.name}": hashlib.sha256(f.read_bytes()).hexdigest()
            for d in shipped_data_for("SmolLM2-135M-Instruct") for f in d.iterdir()}
    assert here and report["inputs"] == here
    assert report["note"] is not None
    assert sorted(p.name for p in folder.iterdir()) == ["datastore.npz", "lookup.json"]
