"""Damaged engine folders: every file the runtime reads is checksummed (the copy datastore and hit
rates and the SPS table too, also when `specrt calibrate` writes them later), corrupt ones are
refused with the file named (by the manifest, and by the loaders themselves), symlinks out of the
folder are refused, and `export` neither replaces an existing folder without --overwrite nor ends
in a raw traceback on a read-only or full destination.

The folders here are built by hand around a placeholder graph: every refusal under test happens
in the manifest check, before a graph is opened (exporting a real one costs a minute on 2 cores;
test_manifest.py does that)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from _onnx_tiny import TARGET_CFG, make_sharp_target, write_hf_target
from specrt.export import manifest as mf
from specrt.plugins.errors import SpecrtError
from specrt.runtime.proposers.datastore import DATASTORE_FILE, NgramDatastore
from specrt.runtime.proposers.lookup_prior import LOOKUP_FILE, LookupPrior
from specrt.runtime.scheduler import SpsTable
from specrt.tools.cli import main as cli_main


def fake_engine(folder: Path, hf: Path) -> Path:
    """An engine folder the manifest check accepts: tokenizer files, a placeholder target graph."""
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, folder / name)
    (folder / "target.onnx").write_bytes(b"placeholder graph")
    config = TARGET_CFG.to_dict()
    manifest = {
        "format": mf.FORMAT, "format_version": mf.FORMAT_VERSION, "name": folder.name,
        "target": {"name": "tiny", "config": config, "fingerprint": mf.target_fingerprint(config)},
        "graphs": {"target": {"file": "target.onnx", "data": None}},
        "tokenizer": {"file": "tokenizer.json", "config": "tokenizer_config.json"},
        "drafter": None, "files": mf.files_table(folder),
    }
    mf.write_manifest(folder, manifest)
    return folder


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return write_hf_target(tmp_path_factory.mktemp("src") / "tiny", make_sharp_target())


def store() -> NgramDatastore:
    return NgramDatastore.build([[5, 9, 23, 7, 5, 9, 23, 8], [3, 4, 5, 9, 23]])


@pytest.fixture()
def calibrated(tmp_path, hf):
    """An engine folder with the files `specrt calibrate` writes after export."""
    folder = fake_engine(tmp_path / "engine", hf)
    store().save(folder / DATASTORE_FILE)
    LookupPrior({1: [10, 4]}, {1: [6, 2]}).save(folder / LOOKUP_FILE)
    SpsTable([1, 2, 4], [100.0, 90.0, 70.0]).save(folder / "sps.json")
    mf.record_files(folder, ["sps.json"])  # as `specrt calibrate` does after writing it
    return folder


def test_files_written_after_export_get_checksums(calibrated):
    files = mf.load_manifest(calibrated).data["files"]
    assert {DATASTORE_FILE, LOOKUP_FILE, "sps.json"} <= set(files)
    assert files[DATASTORE_FILE]["sha256"] == mf.sha256_file(calibrated / DATASTORE_FILE)
    assert not [p for p in calibrated.iterdir() if p.name.startswith(".")]  # the manifest was replaced atomically


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "bit-flipped": flip_a_byte,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("name", [DATASTORE_FILE, LOOKUP_FILE, "sps.json"])
def test_a_damaged_calibration_file_is_refused_by_name(calibrated, name, damage):
    DAMAGE[damage](calibrated / name)
    with pytest.raises(SpecrtError, match=name.replace(".", r"\.")) as err:
        mf.load_manifest(calibrated)
    assert "corrupt" in err.value.problem


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_the_loaders_refuse_damaged_files_themselves(tmp_path, damage):
    """Outside an engine folder (or with checksums off) the readers still fail cleanly. (A flipped
    bit inside an array can read as valid data: only the manifest's checksum catches that.)"""
    path = store().save(tmp_path / "store.npz")
    DAMAGE[damage](path)
    with pytest.raises(SpecrtError, match="cannot read the copy datastore"):
        NgramDatastore.load(path)
    prior = LookupPrior({1: [10, 4]}, {1: [6, 2]}).save(tmp_path / "prior.json")
    DAMAGE[damage](prior)
    with pytest.raises(SpecrtError, match="cannot read the lookup calibration"):
        LookupPrior.load(prior)


def test_generate_with_a_damaged_datastore_is_a_clean_error(calibrated, capsys):
    DAMAGE["truncated"](calibrated / DATASTORE_FILE)
    code = cli_main(["generate", "--engines", str(calibrated), "--drafter", "none", "--prompt", "w5", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code != 0 and DATASTORE_FILE in err and "fix:" in err and "Traceback" not in err


def test_a_calibration_file_without_a_checksum_is_refused(tmp_path, hf):
    folder = fake_engine(tmp_path / "engine", hf)
    NgramDatastore.build([[5, 9, 23, 7]]).save(tmp_path / DATASTORE_FILE)  # not in the folder: no record
    shutil.copy(tmp_path / DATASTORE_FILE, folder / DATASTORE_FILE)  # dropped in by hand
    with pytest.raises(SpecrtError, match="no checksum") as err:
        mf.load_manifest(folder)
    assert "specrt calibrate" in err.value.fix


def test_symlinks_out_of_the_folder_are_refused(tmp_path, hf):
    folder = fake_engine(tmp_path / "engine", hf)
    mf.load_manifest(folder)
    outside = tmp_path / "elsewhere.json"
    shutil.copy(folder / "tokenizer_config.json", outside)  # same bytes: the checksum alone would pass
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").symlink_to(outside)
    with pytest.raises(SpecrtError, match="outside the engine folder"):
        mf.load_manifest(folder)
    # a link inside the folder, and a link to the whole folder, are fine
    (folder / "tokenizer_config.json").unlink()
    shutil.copy(outside, folder / "copy.json")
    (folder / "tokenizer_config.json").symlink_to("copy.json")
    data = json.loads((folder / "manifest.json").read_text())
    data["files"]["copy.json"] = data["files"]["tokenizer_config.json"]
    (folder / "manifest.json").write_text(json.dumps(data))
    mf.load_manifest(folder)
    (tmp_path / "link").symlink_to(folder)
    mf.load_manifest(tmp_path / "link")
    # a folder on a listed path that leads out
    (tmp_path / "real").mkdir()
    shutil.move(str(folder / "copy.json"), tmp_path / "real" / "copy.json")
    (folder / "sub").symlink_to(tmp_path / "real")
    data["files"]["sub/copy.json"] = data["files"].pop("copy.json")
    (folder / "tokenizer_config.json").unlink()
    shutil.copy(outside, folder / "tokenizer_config.json")
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(SpecrtError, match="outside the engine folder"):
        mf.load_manifest(folder)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_export_refuses_an_existing_engine_folder_without_overwrite(tmp_path, hf, capsys):
    from specrt.tools.cli_export import main as export_main

    folder = fake_engine(tmp_path / "engine", hf)
    (folder / "my-notes.txt").write_text("keep me")
    before = snapshot(folder)
    assert export_main(["--drafter", "none", "--target", str(hf), "--out", str(folder), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "existing engine folder" in err and "--overwrite" in err and "Traceback" not in err
    assert snapshot(folder) == before


@pytest.mark.parametrize("code,words", [(errno.ENOSPC, "full disk"), (errno.EROFS, "read-only")])
def test_export_to_a_full_or_read_only_disk_is_a_clean_error(tmp_path, hf, monkeypatch, capsys, code, words):
    """The failure strikes while the first graph is written; the temp folder goes, the old folder stays."""
    from specrt.export import onnx_export
    from specrt.tools.cli_export import main as export_main

    folder = fake_engine(tmp_path / "out" / "engine", hf)
    before = snapshot(folder)

    def failing(spec, out_dir, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(Path(out_dir) / f"{spec.name}.onnx"))

    monkeypatch.setattr(onnx_export, "export_graph", failing)
    assert export_main(["--drafter", "none", "--target", str(hf), "--out", str(folder), "--overwrite", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert words in err and "target.onnx" in err and "fix:" in err and "Traceback" not in err
    assert snapshot(folder) == before
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["engine"]  # no temp folder left
