"""One weights file per engine folder (specrt.export.shared_weights): each tensor stored once, graphs
unchanged in what they compute, the file checksummed like any other."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
import torch
from _onnx_tiny import TARGET_CFG, last_logits, make_drafters, make_sharp_target, write_hf_target
from specrt.export.checkpoints.drafters import save_drafter
from specrt.export.onnx_export import export_graph, graph_specs
from specrt.export.ort_fused import export_fused_target
from specrt.export.quantize import QuantOptions, quantize_graph
from specrt.export.shared_weights import PARTS_KEY, WEIGHTS_FILE, external_files, share_weights
from specrt.plugins.errors import SpecrtError
from specrt.runtime.backends.ort_models import OrtTargetModel
from specrt.runtime.backends.ort_session import OrtGraph, SessionOptions
from specrt.runtime.pipeline import Pipeline
from specrt.tools.cli_export import main as export_main

pytest.importorskip("onnxruntime")

# GroupQueryAttention (the fused graph) wants head sizes in multiples of 16
CFG = TARGET_CFG.__class__(**{**TARGET_CFG.__dict__, "hidden_size": 64, "head_dim": 16})
IDS = [5, 9, 23, 7, 3, 44, 12, 60, 8, 31]


@pytest.fixture(scope="module")
def separate(tmp_path_factory):
    """The portable and the ORT-fused target graph, each saved with its own weights file."""
    folder = tmp_path_factory.mktemp("separate")
    target = make_sharp_target(CFG)
    (spec,) = graph_specs(target)
    graphs = [export_graph(spec, folder, external_data="always"),
              export_fused_target(target, folder, external_data="always")]
    return target, folder, graphs


def _copy(separate, tmp_path, weights: str):
    """A copy of the separate graphs (quantized to int4 when asked), as ExportedGraphs of the copy."""
    import dataclasses

    target, folder, graphs = separate
    out = tmp_path / weights
    shutil.copytree(folder, out)
    copies = [dataclasses.replace(g, path=out / g.path.name, data_path=out / g.data_path.name) for g in graphs]
    if weights == "int4":
        for g in copies:
            quantize_graph(g.path, QuantOptions("int4", 16, True, 0), external_data=True)
    return target, copies


def _logits(target, graphs) -> list[torch.Tensor]:
    """Last-token logits of the portable graph and of the fused one, decoding and verifying."""
    portable, fused = (OrtGraph(g.path, {"inputs": g.inputs, "outputs": g.outputs}, SessionOptions(threads=1))
                       for g in graphs)
    models = [OrtTargetModel(portable, target.config, (), torch.float32),
              OrtTargetModel(portable, target.config, (), torch.float32, fused)]
    return [last_logits(model, IDS, step) for model in models for step in (1, 3)]


def _external_ranges(graph_path) -> dict[str, tuple[int, int]]:
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(str(graph_path), load_external_data=False)
    out = {}
    for t in model.graph.initializer:
        if uses_external_data(t):
            info = ExternalDataInfo(t)
            assert info.location == WEIGHTS_FILE
            out[t.name] = (info.offset, info.length)
    return out


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_two_graphs_store_each_shared_tensor_once_and_compute_the_same(separate, tmp_path, weights):
    target, graphs = _copy(separate, tmp_path, weights)
    folder = graphs[0].path.parent
    before = _logits(target, graphs)
    separate_bytes = sum(g.data_path.stat().st_size for g in graphs)

    summary = share_weights(folder, graphs)

    # one weights file, read by both graphs by a path relative to them; their own files are gone
    assert sorted(p.name for p in folder.iterdir()) == ["target.onnx", "target_ort.onnx", WEIGHTS_FILE]
    assert all(g.data_path == folder / WEIGHTS_FILE and external_files(g.path) == {WEIGHTS_FILE} for g in graphs)
    # the fused graph's packed q|k|v and gate|up (as float or int4 blocks, with their scales) are the
    # portable graph's own tensors side by side: stored as those parts, rebuilt by a Concat
    nodes = onnx.load(str(graphs[1].path), load_external_data=False).graph.node
    packs = {n.output[0] for n in nodes if n.op_type == "Concat" and n.name.endswith(".pack")}
    marked = [n for n in nodes if any(p.key == PARTS_KEY for p in n.metadata_props)]
    assert len(marked) == 2 * CFG.num_layers and all(n.input[1] in packs for n in marked)
    assert len(packs) == summary.packed_as_parts  # int4: scales too, where their parts are over 1 KiB
    # every byte string is in the file once: no two ranges hold equal bytes, and nothing else is there
    data = (folder / WEIGHTS_FILE).read_bytes()
    ranges = {r for g in graphs for r in _external_ranges(g.path).values()}
    contents = [data[offset:offset + length] for offset, length in ranges]
    assert len(set(contents)) == len(contents) == summary.stored
    assert len(data) == sum(length for _, length in ranges)  # tiny tensors: no alignment padding
    # the embedding (the portable graph's tied head) is one range read by both graphs
    portable, fused = (_external_ranges(g.path) for g in graphs)
    assert fused["embed_tokens.weight"] in set(portable.values())
    assert len(data) < 0.75 * separate_bytes

    after = _logits(target, graphs)
    for got, want in zip(after, before):
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def eagle_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    target = make_sharp_target(CFG)
    write_hf_target(root / "tiny", target)
    save_drafter(make_drafters(target)["eagle3"], root / "ckpt", dtype=torch.float32)
    out = root / "engine"
    assert export_main(["--drafter", "eagle3", "--target", str(root / "tiny"), "--drafter-ckpt", str(root / "ckpt"),
                        "--out", str(out), "--quiet"]) == 0
    return out


def test_the_manifest_lists_the_shared_file_once_with_its_checksum(eagle_folder):
    manifest = json.loads((eagle_folder / "manifest.json").read_text())
    graphs = manifest["graphs"]
    assert set(graphs) == {"target", "target_ort", "target_ort_causal", "eagle3_fc", "eagle3_step"}
    assert all(g["data"] == WEIGHTS_FILE for g in graphs.values())
    assert not list(eagle_folder.glob("*.onnx.data"))
    assert manifest["files"][WEIGHTS_FILE]["bytes"] == (eagle_folder / WEIGHTS_FILE).stat().st_size
    # the drafter's step reads the target's embedding from the same bytes
    step = _external_ranges(eagle_folder / "eagle3_step.onnx")
    fused = _external_ranges(eagle_folder / "target_ort.onnx")
    assert fused["embed_tokens.weight"] in set(step.values())
    # the causal twin adds no weights: every tensor it reads is one of target_ort's bytes
    assert set(_external_ranges(eagle_folder / "target_ort_causal.onnx").values()) <= set(fused.values())


def test_a_corrupted_shared_weights_file_is_refused_by_name(eagle_folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(eagle_folder, broken)
    weights = broken / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x40  # same size, one bit of one weight
    weights.write_bytes(bytes(data))
    with pytest.raises(SpecrtError) as info:
        Pipeline.from_engines(broken, threads=1)
    assert WEIGHTS_FILE in info.value.problem and "corrupt" in info.value.problem
