"""`specrt build`: what runs without TensorRT - refusals, profiles, the plugin rewrite, plan records.

The engine folders here are made by hand from the real graph specifications of tiny models (no ONNX
export: the builder reads shapes from the manifest, and load_manifest checks files and checksums,
not ONNX contents), so the file runs in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _onnx_tiny import TARGET_CFG, make_drafters, make_target
from specrt.export import build
from specrt.export import manifest as mf
from specrt.plugins.errors import SpecrtError
from specrt.plugins.trt_api import tensorrt_available

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.long: "int64", torch.bool: "bool"}
USES_ATTENTION = {"target", "eagle3_step", "dflash_block", "dspark_block"}


def make_folder(folder: Path, kind: str = "dspark", capacity: int = 96) -> Path:
    """An engine folder whose manifest matches what `specrt export` writes for the tiny models."""
    from specrt.export.onnx_export import ExportedGraph, graph_specs

    folder.mkdir(parents=True)
    target = make_target()
    drafter = make_drafters(target)[kind] if kind != "none" else None
    graphs = []
    for spec in graph_specs(target, drafter):
        path = folder / f"{spec.name}.onnx"
        path.write_bytes(b"graph " + spec.name.encode())
        ops = ["specrt::TreeAttention"] if spec.name in USES_ATTENTION else []
        if spec.name == "dspark_block":
            ops.append("specrt::ConfidenceTruncate")
        inputs = [{"name": n, "dtype": DTYPES[d], "shape": list(s)} for n, d, s in spec.inputs]
        outputs = [{"name": n, "dtype": "float32", "shape": list(s)} for n, s in spec.outputs]
        graphs.append(ExportedGraph(spec.name, spec.description, path, None, 0.0, ops, inputs, outputs))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    info = None
    if drafter is not None:
        roles = {g.name.split("_", 1)[1]: g.name for g in graphs if g.name != "target"}
        extra: dict = {}
        if kind == "eagle3":
            np.save(folder / "draft_to_target.npy", np.arange(40, dtype=np.int64))
            extra = {"draft_vocab": {"file": "draft_to_target.npy", "size": 40},
                     "tree": {"top_k": 4, "depth": 4, "total_tokens": 24}}
        info = mf.drafter_section(drafter, None, target.config, roles, extra)
    data = mf.build_manifest(folder, name=folder.name, target_model=target, target_name="tiny", target_source=None,
                             chat_template=None, graphs=graphs, drafter_info=info,
                             export_options={"dtype": "float32", "opset": 20, "kv_capacity": capacity})
    mf.write_manifest(folder, data)
    mf.load_manifest(folder)  # the fixture itself must be a valid folder
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    return {kind: make_folder(root / f"tiny-{kind}", kind) for kind in ("dspark", "eagle3", "none")}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specrt.export.build", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


# -- refusals ------------------------------------------------------------------------------------------
@pytest.mark.skipif(tensorrt_available(), reason="TensorRT is installed here: the refusal does not apply")
def test_build_cli_without_tensorrt_exits_2_with_problem_and_fix(folders):
    proc = run_cli("--engines", str(folders["dspark"]), "--trt")
    assert proc.returncode == 2, proc.stderr
    assert "specrt build: error: TensorRT is not installed" in proc.stderr
    assert "fix: install TensorRT 10.x" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(folders["dspark"].glob("*.plan"))  # nothing written


def test_build_cli_refuses_bad_input_before_touching_tensorrt(folders, tmp_path):
    cases = [
        (["--engines", str(tmp_path / "missing"), "--trt"], "engine folder not found"),
        (["--engines", str(folders["dspark"])], "pass --trt"),
        (["--engines", str(folders["dspark"]), "--trt", "--plugin-lib", str(tmp_path / "libnope.so")],
         "plugin library"),
        (["--engines", str(folders["dspark"]), "--trt", "--max-step", "0"], "--max-step must be >= 1"),
        (["--engines", str(folders["dspark"]), "--trt", "--capacity", "100000"], "max_position_embeddings"),
        (["--engines", str(folders["dspark"]), "--trt", "--graphs", "nope"], "no graph 'nope'"),
        (["--engines", str(folders["dspark"]), "--trt", "--max-batch", "100"], "ConfidenceTruncate plugin"),
        (["--engines", str(folders["dspark"]), "--trt", "--timing-cache", str(tmp_path / "no" / "t.cache")],
         "does not exist"),
    ]
    for args, message in cases:
        code = build.main(args)
        assert code == 2, args
    # one through a real process: two lines on stderr, no traceback
    proc = run_cli("--engines", str(tmp_path / "missing"), "--trt")
    assert proc.returncode == 2 and "engine folder not found" in proc.stderr and "Traceback" not in proc.stderr
    for args, message in cases:
        with pytest.raises(SpecrtError, match=message.replace("(", r"\(")):
            build.run(_parse(args))


def _parse(args: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    build.add_arguments(parser)
    return parser.parse_args(args)


def test_build_cli_flags_are_exclusive_and_registered():
    with pytest.raises(SystemExit):
        _parse(["--engines", "x", "--trt", "--fp16", "--bf16"])
    cli = (ROOT / "tools" / "cli.py").read_text()
    assert '"build": ("specrt.export.build"' in cli


def test_build_refuses_an_op_without_plugin():
    build.check_plugin_coverage("target", ["specrt::TreeAttention"], {"specrt::TreeAttention"})
    with pytest.raises(SpecrtError) as err:
        build.check_plugin_coverage("dspark_block", ["specrt::TreeAttention", "specrt::ConfidenceTruncate"],
                                    {"specrt::TreeAttention"})
    assert "specrt::ConfidenceTruncate" in err.value.problem and "--no-plugins" in err.value.fix


# -- profiles ------------------------------------------------------------------------------------------
def test_build_limits_default_from_the_manifest(folders):
    dspark = json.loads((folders["dspark"] / "manifest.json").read_text())
    limits = build.resolve_limits(dspark)
    assert limits == build.Limits(max_batch=1, max_prefill=96, max_step=16, capacity=96, block=4)
    eagle = json.loads((folders["eagle3"] / "manifest.json").read_text())
    assert build.resolve_limits(eagle).max_step == 24  # the recorded tree's verify tokens
    assert build.resolve_limits(eagle, max_batch=4, max_prefill=32, max_step=8, capacity=64) == build.Limits(
        4, 32, 8, 64, None)
    with pytest.raises(SpecrtError, match="exceed the KV capacity"):
        build.resolve_limits(eagle, max_prefill=65, capacity=64)


def test_build_profiles_cover_prefill_and_steps(folders):
    data = json.loads((folders["dspark"] / "manifest.json").read_text())
    limits = build.Limits(max_batch=2, max_prefill=64, max_step=8, capacity=96, block=4)
    target = build.graph_profiles("target", data["graphs"]["target"], limits)
    assert [p.name for p in target] == ["step", "prefill"]
    step, prefill = target
    assert step.shapes["input_ids"] == ([1, 1], [1, 8], [2, 8])
    assert prefill.shapes["input_ids"] == ([1, 1], [1, 64], [2, 64])
    assert step.shapes["past_mask"] == ([1, 1, 0], [1, 8, 96], [2, 8, 96])
    assert step.shapes["tree_mask"] == ([1, 1, 1], [1, 8, 8], [2, 8, 8])
    kv, d = TARGET_CFG.num_kv_heads, TARGET_CFG.head_dim
    assert step.shapes["past_key_5"] == ([1, kv, 1, d], [1, kv, 96, d], [2, kv, 96, d])
    assert set(step.shapes) == {i["name"] for i in data["graphs"]["target"]["inputs"]}
    block = build.graph_profiles("dspark_block", data["graphs"]["dspark_block"], limits)
    assert [p.name for p in block] == ["step"]  # no seq dim: one profile
    assert block[0].shapes["block_ids"] == ([1, 4], [1, 4], [2, 4])  # gamma is static in the graph
    assert block[0].shapes["sps"] == ([1], [1], [2 * 4 + 1])
    assert block[0].shapes["threshold"] == ([], [], [])
    # the runtime picks the first profile that holds a call
    profiles = [build.plan_record("t", "t.plan", target, build.Device("x", "9.0"), "10.8", "fp32", "aot", 1.0)][0][
        "profiles"]
    assert build.pick_profile(profiles, {"input_ids": (1, 3), "past_mask": (1, 3, 50)}) == 0
    assert build.pick_profile(profiles, {"input_ids": (2, 40), "past_mask": (2, 40, 0)}) == 1
    with pytest.raises(SpecrtError, match="no optimization profile"):
        build.pick_profile(profiles, {"input_ids": (3, 1)})


def test_build_profiles_refuse_unknown_dims():
    graph = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", "mystery"]}]}
    with pytest.raises(SpecrtError, match="mystery"):
        build.graph_profiles("g", graph, build.Limits())
    graph = {"inputs": [{"name": "x", "dtype": "int64", "shape": ["batch", "block"]}]}
    with pytest.raises(SpecrtError, match="block size"):
        build.graph_profiles("g", graph, build.Limits(block=None))


# -- the plugin rewrite of the ONNX graph ------------------------------------------------------------
def test_build_marks_specrt_nodes_for_the_plugin_importer(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    from specrt.plugins import onnx_ops

    V = helper.make_tensor_value_info
    inputs = [V("query", TensorProto.FLOAT, ["B", 4, "T", 8]), V("key", TensorProto.FLOAT, ["B", 2, "T", 8]),
              V("value", TensorProto.FLOAT, ["B", 2, "T", 8]), V("past_key", TensorProto.FLOAT, ["B", 2, "C", 8]),
              V("past_value", TensorProto.FLOAT, ["B", 2, "C", 8]), V("past_mask", TensorProto.BOOL, ["B", "T", "S"]),
              V("tree_mask", TensorProto.BOOL, ["B", "T", "T"])]
    model = onnx_ops.single_op_model("TreeAttention", inputs, [V("attn", TensorProto.FLOAT, ["B", 4, "T", 8])],
                                     {"scale": 0.25})
    # a weight stored as external data must still resolve from the marked copy
    weight = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    model.graph.initializer.append(weight)
    model.graph.node.append(helper.make_node("Identity", ["w"], ["w_out"]))
    model.graph.output.append(V("w_out", TensorProto.FLOAT, [2, 3]))
    source = tmp_path / "graph.onnx"
    onnx.save(model, str(source), save_as_external_data=True, location="graph.onnx.data", size_threshold=0)
    marked_path = build.write_plugin_graph(source, aot=True)
    try:
        assert marked_path.parent == source.parent and marked_path.name.startswith(".graph.plugins-")
        marked = onnx.load(str(marked_path))
        node = next(n for n in marked.graph.node if n.domain == "specrt")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"scale": pytest.approx(0.25), "plugin_namespace": b"specrt", "aot": 1}
        assert [f.name for f in marked.functions] == ["TreeAttention"]  # the body stays (--no-plugins, other runtimes)
        got = numpy_helper.to_array(next(i for i in marked.graph.initializer if i.name == "w"))
        assert np.array_equal(got, np.arange(6, dtype=np.float32).reshape(2, 3))
        # marking twice does not duplicate attributes; JIT mode drops aot
        assert build.plugin_model(marked, aot=False) == ["TreeAttention"]
        assert sorted(a.name for a in marked.graph.node[0].attribute) == ["plugin_namespace", "scale"]
    finally:
        marked_path.unlink()
    assert onnx.load(str(source)).graph.node[0].attribute[0].name == "scale"  # the exported graph is untouched


# -- plan records and the runtime's compatibility check ----------------------------------------------
def test_build_records_plans_the_manifest_loader_accepts(folders, tmp_path):
    folder = tmp_path / "engine"
    shutil.copytree(folders["dspark"], folder)
    data = json.loads((folder / "manifest.json").read_text())
    limits = build.resolve_limits(data)
    (folder / "target.plan").write_bytes(b"\x00plan bytes")
    profiles = build.graph_profiles("target", data["graphs"]["target"], limits)
    record = build.plan_record("target", "target.plan", profiles, build.Device("NVIDIA H200", "9.0"), "10.13.0.35",
                               "fp16", "aot", 12.34)
    files = {"target.plan": {"sha256": mf.sha256_file(folder / "target.plan"), "bytes": 11}}
    new = build.record_plans(data, {"target": record}, files, limits, "timing.cache")
    assert "tensorrt" not in data  # the input is not modified
    build._write_manifest_atomic(folder, new)
    loaded = mf.load_manifest(folder).data
    plan = loaded["tensorrt"]["plans"]["target"]
    assert plan["compute_capability"] == "9.0" and plan["tensorrt_version"] == "10.13.0.35"
    assert plan["precision"] == "fp16" and plan["plugins"] == "aot" and plan["build_seconds"] == 12.3
    assert [p["name"] for p in plan["profiles"]] == ["step", "prefill"]
    assert loaded["tensorrt"]["limits"]["capacity"] == limits.capacity
    assert loaded["files"]["target.plan"]["bytes"] == 11
    (folder / "target.plan").write_bytes(b"\x00plan bytez")  # a corrupt plan is caught by the checksum
    with pytest.raises(SpecrtError, match="corrupt"):
        mf.load_manifest(folder)


def test_runtime_refuses_plans_for_another_gpu_or_tensorrt():
    record = {"graph": "target", "compute_capability": "8.7", "device": "Orin", "tensorrt_version": "10.3.0"}
    build.check_plan_compatible(record, "8.7", "10.3.0")
    with pytest.raises(SpecrtError) as err:
        build.check_plan_compatible(record, "9.0", "10.3.0", "engines/x")
    assert "compute capability 8.7" in err.value.problem and "this GPU has 9.0" in err.value.problem
    assert err.value.fix == "rebuild the plans on this machine: specrt build --engines engines/x --trt"
    with pytest.raises(SpecrtError, match="built with TensorRT 10.3.0; this machine has 10.13"):
        build.check_plan_compatible(record, "8.7", "10.13.0.35")


def test_trt_backend_refuses_a_folder_without_plans(folders):
    from specrt.runtime.backends.trt_backend import load_trt_engines

    with pytest.raises(SpecrtError) as err:
        load_trt_engines(folders["none"])
    assert "no TensorRT plans" in err.value.problem and "specrt build" in err.value.fix


# -- the C++ example -----------------------------------------------------------------------------------
def _tensorrt_include() -> Path | None:
    candidates = [os.environ.get("TENSORRT_ROOT", ""), "/usr/include/x86_64-linux-gnu", "/usr/include/aarch64-linux-gnu",
                  "/usr/include", "/usr/local/TensorRT/include", "/usr/src/tensorrt/include", "/opt/tensorrt/include"]
    for c in candidates:
        for path in (Path(c), Path(c) / "include"):
            if c and (path / "NvInfer.h").is_file():
                return path
    return None


def test_cpp_example_compiles_against_tensorrt_headers(tmp_path):
    include = _tensorrt_include()
    if include is None:
        pytest.skip("TensorRT headers (NvInfer.h) are not installed here; set TENSORRT_ROOT to compile the example")
    cuda = next((p for p in ("/usr/local/cuda/include", "/usr/include") if (Path(p) / "cuda_runtime_api.h").is_file()),
                None)
    if cuda is None or shutil.which("g++") is None:
        pytest.skip("the CUDA runtime headers or g++ are missing")
    proc = subprocess.run(["g++", "-std=c++17", "-Wall", "-fsyntax-only", f"-I{include}", f"-I{cuda}",
                           str(ROOT / "examples" / "cpp" / "verify_step.cpp")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
