"""`specrt generate --drafter ...` on the embedded default with drafters written by the test."""

from __future__ import annotations

import subprocess

import pytest
import torch

from specrt.export.checkpoints.drafters import save_drafter
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter
from specrt.export.models.dspark import DSparkConfig, DSparkDrafter
from specrt.export.models.eagle3 import Eagle3Config, Eagle3Drafter
from specrt.tools.cli import main


@pytest.fixture(scope="module")
def drafter_dirs(default_target, tmp_path_factory):
    cfg = default_target.model.config
    torch.manual_seed(0)
    made = {
        "eagle3": Eagle3Drafter(Eagle3Config.for_target(cfg, 4096, intermediate_size=256)),
        "dflash": DFlashDrafter(DFlashConfig.for_target(cfg, num_layers=1, block_size=6, intermediate_size=256)),
        "dspark": DSparkDrafter(DSparkConfig.for_target(cfg, num_layers=1, block_size=5, intermediate_size=256,
                                                        markov_rank=32)),
    }
    out = {}
    for kind, drafter in made.items():
        out[kind] = tmp_path_factory.mktemp(kind)
        save_drafter(drafter, out[kind])
    return out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["specrt", "generate", "--prompt", "Name a color.", "--max-new-tokens", "16", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def plain_text():
    out = run_cli()
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_generate_with_each_drafter_equals_plain(drafter_dirs, kind, plain_text):
    plain = plain_text
    spec = run_cli("--drafter", kind, "--drafter-ckpt", str(drafter_dirs[kind]))
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain
    assert spec.stderr.strip().splitlines()[-1].startswith("tau ")


def test_drafter_for_another_target_is_refused(tmp_path, capsys):
    from specrt.export.models import LlamaConfig

    other = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
    save_drafter(DFlashDrafter(DFlashConfig.for_target(other, block_size=4, num_taps=2)), tmp_path)
    code = main(["generate", "--prompt", "hi", "--drafter", "dflash", "--drafter-ckpt", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "fix:" in err
    assert "hidden" in err.lower() or "vocab" in err.lower()


def test_drafter_kind_mismatch_and_missing_checkpoint(drafter_dirs, capsys):
    code = main(["generate", "--prompt", "hi", "--drafter", "eagle3", "--drafter-ckpt", str(drafter_dirs["dflash"])])
    err = capsys.readouterr().err
    assert code == 2 and "fix:" in err
    # drafters ship for the embedded default only: a target given by path needs --drafter-ckpt
    from specrt.export.default_model import find_default_gguf

    code = main(["generate", "--prompt", "hi", "--drafter", "dspark", "--target", str(find_default_gguf())])
    err = capsys.readouterr().err
    assert code == 2 and "--drafter-ckpt" in err
