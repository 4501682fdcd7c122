"""engines/<name>/manifest.json: contents, validation, and an export that never leaves a bad folder."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _onnx_tiny import make_drafters, make_target, write_hf_target
from specrt.export import manifest as mf
from specrt.export.checkpoints.drafters import save_drafter
from specrt.plugins.errors import SpecrtError
from specrt.export.export import export_engine
from specrt.tools.cli_export import main

pytest.importorskip("onnxruntime")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    target = make_target()
    drafters = make_drafters(target)
    write_hf_target(root / "tiny", target)
    for kind, drafter in drafters.items():
        save_drafter(drafter, root / kind, dtype=torch.float32)
    from specrt.export.models import LlamaConfig
    from specrt.export.models.dflash import DFlashConfig, DFlashDrafter

    other = LlamaConfig(vocab_size=100, hidden_size=48, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2)
    save_drafter(DFlashDrafter(DFlashConfig.for_target(other, block_size=4, num_taps=2)), root / "other_dflash")
    return root


@pytest.fixture(scope="module")
def engine(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("engines") / "tiny-dspark"
    code = main(["--drafter", "dspark", "--target", str(sources / "tiny"), "--drafter-ckpt", str(sources / "dspark"),
                 "--out", str(out), "--quiet"])
    assert code == 0
    return out


def snapshot(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def corrupt_copy(engine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / engine.name
    shutil.copytree(engine, copy)
    return copy


def edit_manifest(folder: Path, change) -> None:
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


# -- contents -------------------------------------------------------------------------------------------
def test_manifest_holds_what_design_section_2_lists(engine):
    data = json.loads((engine / "manifest.json").read_text())
    assert data["format"] == "specrt.engine" and data["format_version"] == mf.FORMAT_VERSION
    target = data["target"]
    assert target["config"]["hidden_size"] == 32 and target["config"]["num_layers"] == 6
    assert target["vocab_size"] == 64 and 1 in target["eos_token_ids"] and target["chat_template"]
    assert target["tap_layers"] == data["drafter"]["tap_layers"]
    drafter = data["drafter"]
    assert drafter["kind"] == "dspark" and drafter["config"]["block_size"] == 4 and drafter["block_size"] == 4
    assert drafter["mask_token_id"] == drafter["config"]["mask_token_id"]
    assert len(drafter["sts_temperatures"]) == 4
    assert drafter["graphs"] == {"ingest": "dspark_ingest", "block": "dspark_block"}
    assert set(data["graphs"]) == {"target", "dspark_ingest", "dspark_block"}
    for graph in data["graphs"].values():
        assert (engine / graph["file"]).is_file()
        for io in graph["inputs"] + graph["outputs"]:
            assert set(io) == {"name", "dtype", "shape"}
    block_inputs = {i["name"]: i for i in data["graphs"]["dspark_block"]["inputs"]}
    assert block_inputs["past_mask"] == {"name": "past_mask", "dtype": "bool", "shape": ["batch", 4, "past"]}
    assert {(op["domain"], op["name"]) for op in data["custom_ops"]} == {("specrt", "TreeAttention"),
                                                                          ("specrt", "ConfidenceTruncate")}
    assert data["tokenizer"]["file"] == "tokenizer.json"
    assert all(data["versions"][k] for k in ("torch", "onnx", "onnxscript", "python"))
    files = {p.relative_to(engine).as_posix() for p in engine.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(data["files"]) == files
    for name, entry in data["files"].items():
        assert entry["sha256"] == hashlib.sha256((engine / name).read_bytes()).hexdigest()


def test_load_manifest_gives_configs_and_paths(engine):
    loaded = mf.load_manifest(engine)
    assert loaded.target_config.vocab_size == 64 and loaded.drafter_kind == "dspark"
    assert loaded.drafter_config.markov_rank == 8
    assert loaded.graph_path("dspark_block") == engine / "dspark_block.onnx"
    with pytest.raises(SpecrtError, match="no graph 'eagle3_step'"):
        loaded.graph_path("eagle3_step")


def test_compare_cli_on_the_engine(engine, capsys):
    from specrt.tools.compare import main as compare_main

    assert compare_main([str(engine), "--no-polygraphy"]) == 0
    out = capsys.readouterr().out
    assert "== target" in out and "== dspark_block" in out and "FAIL" not in out


# -- refusals -------------------------------------------------------------------------------------------
def test_wrong_checksum_is_refused_and_nothing_is_touched(engine, tmp_path):
    copy = corrupt_copy(engine, tmp_path)
    data = bytearray((copy / "dspark_block.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "dspark_block.onnx").write_bytes(bytes(data))
    before = snapshot(copy)
    with pytest.raises(SpecrtError) as info:
        mf.load_manifest(copy)
    assert "dspark_block.onnx" in info.value.problem and "corrupt" in info.value.problem and info.value.fix
    assert snapshot(copy) == before


def test_missing_graph_file_is_refused(engine, tmp_path):
    copy = corrupt_copy(engine, tmp_path)
    (copy / "target.onnx").unlink()
    with pytest.raises(SpecrtError) as info:
        mf.load_manifest(copy)
    assert "target.onnx" in info.value.problem and "missing" in info.value.problem
    assert "export" in info.value.fix


def test_unknown_format_version_and_non_engine_folders(engine, tmp_path):
    copy = corrupt_copy(engine, tmp_path)
    edit_manifest(copy, lambda d: d.update(format_version=99))
    with pytest.raises(SpecrtError, match="format_version 99") as info:
        mf.load_manifest(copy)
    assert "upgrade specrt" in info.value.fix
    with pytest.raises(SpecrtError, match="not an exported engine folder"):
        mf.load_manifest(tmp_path)
    with pytest.raises(SpecrtError, match="engine folder not found"):
        mf.load_manifest(tmp_path / "nope")
    edit_manifest(copy, lambda d: d.update(format_version=1, graphs={**d["graphs"], "x": {"file": "../x.onnx"}}))
    with pytest.raises(SpecrtError, match="outside the engine folder"):
        mf.load_manifest(copy)


def test_drafter_for_another_target_is_refused(engine, tmp_path):
    copy = corrupt_copy(engine, tmp_path)
    edit_manifest(copy, lambda d: d["drafter"]["config"].update(vocab_size=100))
    with pytest.raises(SpecrtError, match="does not fit") as info:
        mf.load_manifest(copy)
    assert "vocab" in info.value.problem

    copy2 = corrupt_copy(engine, tmp_path / "b")
    edit_manifest(copy2, lambda d: d["drafter"].update(target_fingerprint="0" * 64))
    with pytest.raises(SpecrtError, match="exported for another target"):
        mf.load_manifest(copy2)

    copy3 = corrupt_copy(engine, tmp_path / "c")
    edit_manifest(copy3, lambda d: d["drafter"]["config"].update(tap_layers=[1, 2, 3]))
    with pytest.raises(SpecrtError, match="taps"):
        mf.load_manifest(copy3)


# -- the exporter: atomic output ------------------------------------------------------------------------
def test_failed_export_never_overwrites_a_good_folder(engine, sources, tmp_path, capsys, monkeypatch):
    before = snapshot(engine)
    siblings = sorted(p.name for p in engine.parent.iterdir())
    # a drafter trained for another target: refused before anything is written
    code = main(["--drafter", "dflash", "--target", str(sources / "tiny"), "--drafter-ckpt",
                 str(sources / "other_dflash"), "--out", str(engine), "--overwrite", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "fix:" in err and "Traceback" not in err
    # a failure half way through the graphs: the temp folder goes, the old folder stays
    from specrt.export import onnx_export

    real = onnx_export.export_graph
    calls = []

    def flaky(spec, *args, **kwargs):
        calls.append(spec.name)
        if len(calls) == 2:
            raise RuntimeError("simulated exporter crash")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(onnx_export, "export_graph", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        export_engine("dspark", target=sources / "tiny", drafter_ckpt=sources / "dspark", out=engine, quiet=True,
                      overwrite=True)
    assert snapshot(engine) == before
    assert sorted(p.name for p in engine.parent.iterdir()) == siblings  # no temp or backup folders left


def test_no_drafter_checkpoint_says_how_to_get_one(sources, capsys, monkeypatch):
    assert main(["--drafter", "dspark", "--target", str(sources / "tiny")]) == 2
    err = capsys.readouterr().err
    assert "--drafter-ckpt" in err and "specrt train" in err and "--drafter none" in err
    from specrt.export import export as export_cli

    monkeypatch.setattr(export_cli, "_shipped_drafter", lambda kind: None)  # default target, nothing shipped
    assert main(["--drafter", "eagle3"]) == 2
    assert "--drafter-ckpt" in capsys.readouterr().err


def test_refuses_to_replace_a_folder_that_is_not_an_engine(sources, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(SpecrtError, match="not a specrt engine folder"):
        export_engine("none", target=sources / "tiny", out=tmp_path / "mine", quiet=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_target_only_export_replaces_an_engine_folder(engine, sources, tmp_path):
    copy = corrupt_copy(engine, tmp_path)
    out = export_engine("none", target=sources / "tiny", out=copy, quiet=True, overwrite=True)
    loaded = mf.load_manifest(out)
    assert loaded.data["drafter"] is None and set(loaded.graphs) == {"target"}
    assert [o["name"] for o in loaded.graphs["target"]["outputs"]] == ["logits", "new_keys", "new_values"]
    assert not (copy / "dspark_block.onnx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [copy.name]


def test_cli_entry_points():
    for cmd in (["specrt", "export", "--help"], [sys.executable, "-m", "specrt.tools", "export", "--help"]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert "--drafter" in out.stdout and "--drafter-ckpt" in out.stdout
