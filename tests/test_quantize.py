"""Weight-only int8/int4 engines (ONNX Runtime MatMulNBits) on a tiny target: structure, accuracy,
lossless speculation against the quantized target, and the quality report."""

from __future__ import annotations

import json
import logging

import onnx
import pytest
import torch

from _onnx_tiny import make_drafters, make_sharp_target, write_hf_target
from specrt.export.checkpoints.drafters import save_drafter
from specrt.plugins.errors import SpecrtError
from specrt.tools.cli_export import main as export_main
from specrt.export.quantize import QuantOptions
from specrt.runtime.pipeline import Pipeline

pytest.importorskip("onnxruntime")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)
PROMPTS = [[5, 9, 23, 7], [3, 44, 12, 60, 8, 31, 2]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    target = make_sharp_target()
    drafter = make_drafters(target)["dspark"]
    write_hf_target(root / "tiny", target)
    save_drafter(drafter, root / "ckpt", dtype=torch.float32)
    out = {}
    for weights in ("fp32", "int8", "int4"):
        out[weights] = root / f"engine-{weights}"
        assert export_main(["--drafter", "dspark", "--target", str(root / "tiny"), "--drafter-ckpt", str(root / "ckpt"),
                            "--out", str(out[weights]), "--weights", weights, "--quant-block", "16",
                            # level 0: the batch-invariant kernel; level 4 needs the runtime's exact-decoding rules (docs/exactness.md)
                            "--quant-accuracy-level", "0", "--quiet"]) == 0
    return out


def test_quantized_graphs_use_matmulnbits_and_the_manifest_says_so(engines):
    for weights, bits in (("int8", 8), ("int4", 4)):
        model = onnx.load(str(engines[weights] / "target.onnx"), load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        assert "MatMulNBits" in ops and "Gemm" not in ops  # the LM head was quantized too
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert all(a.i == bits for n in nbits for a in n.attribute if a.name == "bits")
        manifest = json.loads((engines[weights] / "manifest.json").read_text())
        assert manifest["export"]["weights"]["bits"] == bits and manifest["export"]["weights"]["block_size"] == 16
    manifest = json.loads((engines["fp32"] / "manifest.json").read_text())
    assert manifest["export"]["weights"]["bits"] is None


def fake_quant_int4(model, block: int):
    """Symmetric round-to-nearest int4 of every Linear weight along its input dim, scale absmax / 8."""
    import copy

    model = copy.deepcopy(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                out_dim, in_dim = module.weight.shape
                w = module.weight.reshape(out_dim, in_dim // block, block)
                scale = w.abs().amax(-1, keepdim=True) / 8
                module.weight.copy_(((w / scale).round().clamp(-8, 7) * scale).reshape(out_dim, in_dim))
    return model


def test_quantized_logits_follow_the_quantized_weights(engines):
    """int8 stays close to fp32; int4 behaves like int4 rounding of the same weights (a random 6-layer net
    amplifies rounding too much for int4 to stay near fp32, which the real-model report measures)."""
    from specrt.export.checkpoints import load_target
    from specrt.runtime.backends.torch_backend import TorchTargetEngine
    from specrt.runtime.engine import causal_mask

    ids = torch.tensor([PROMPTS[1]])
    t = ids.shape[1]

    def forward(engine):
        engine.set_taps(())
        engine.reset(1)
        return engine.forward(ids, torch.arange(t)[None], causal_mask(1, t))[0][0]

    logits = {w: forward(Pipeline.from_engines(folder, drafter="none").engine_for(t + 1)) for w, folder in engines.items()}
    model = load_target(engines["fp32"].parent / "tiny").model
    rounded = forward(TorchTargetEngine(fake_quant_int4(model, 16), t + 8))

    def cos(a, b):
        return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())

    assert cos(logits["int8"], logits["fp32"]) > 0.99
    assert cos(logits["int4"], rounded) > cos(logits["int4"], logits["fp32"]) + 0.1


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_speculation_is_lossless_against_the_quantized_target(engines, weights):
    pipe = Pipeline.from_engines(engines[weights], drafter="dspark")
    plain = pipe.generate_ids(PROMPTS, 20, speculative=False)
    spec = pipe.generate_ids(PROMPTS, 20)
    assert spec.tokens == plain.tokens
    assert pipe.proposer.name == "dspark+lookup"  # the folder records copies from the text by default


def test_quant_report_runs_on_the_tiny_engines(engines, tmp_path, monkeypatch):
    import specrt.tools.datasets as datasets
    from specrt.tools import quant_report

    monkeypatch.setattr(datasets, "mtbench_questions", lambda: [{"turns": ["w5 w9"]}, {"turns": ["w40 w2 w7"]}])
    monkeypatch.setattr(quant_report, "held_out",
                        lambda data, count: [{"prompt": [5, 9, 23], "response": [7, 8, 9, 10]}] * 2)
    code = quant_report.main(["--engines", ",".join(str(engines[w]) for w in ("fp32", "int8", "int4")),
                              "--prompts", "2", "--tokens", "12", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "quant.json").read_text())
    assert len(report["results"]) == 3
    for r in report["results"].values():
        assert r["perplexity"] > 1.0 and r["ppl_tokens"] == 8
    assert (tmp_path / "first_divergence.png").stat().st_size > 0


def test_first_divergence():
    from specrt.tools.quant_report import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3], 3) == 3
    assert first_divergence([1, 2, 3], [1, 5, 3], 3) == 1
    assert first_divergence([1, 2], [1, 2, 3], 3) == 2
    assert first_divergence([1, 2], [1, 2], 8) == 8


def test_an_int4_drafter_beside_an_fp32_target_changes_drafts_not_output(engines, tmp_path):
    """--drafter-weights int4: the drafter's graphs get MatMulNBits, the target stays fp32, and the
    output still equals the fp32 target's plain decoding (verification decides it)."""
    root = engines["fp32"].parent
    out = tmp_path / "engine-fp32-drafter-int4"
    assert export_main(["--drafter", "dspark", "--target", str(root / "tiny"), "--drafter-ckpt", str(root / "ckpt"),
                        "--out", str(out), "--drafter-weights", "int4", "--quant-block", "16", "--quiet"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["export"]["weights"]["bits"] is None and manifest["export"]["drafter_weights"]["bits"] == 4
    for graph in manifest["graphs"]:
        ops = {n.op_type for n in onnx.load(str(out / manifest["graphs"][graph]["file"]), load_external_data=False).graph.node}
        # _fc / _ingest graphs stay float whatever the scheme (small, run once per committed token)
        drafts = not graph.startswith("target") and not graph.endswith(("_fc", "_ingest"))
        assert ("MatMulNBits" in ops) == drafts, graph
    plain = Pipeline.from_engines(engines["fp32"]).generate_ids(PROMPTS, 20, speculative=False)
    assert Pipeline.from_engines(out).generate_ids(PROMPTS, 20).tokens == plain.tokens
    with pytest.raises(SystemExit):
        export_main(["--drafter", "dspark", "--drafter-weights", "int2", "--out", str(tmp_path / "x"), "--quiet"])
    assert export_main(["--drafter", "none", "--target", str(root / "tiny"), "--drafter-weights", "int4",
                        "--out", str(tmp_path / "y"), "--quiet"]) != 0  # no drafter: refused with the fix


def test_bad_quantization_options_are_refused():
    with pytest.raises(SpecrtError, match="power of two"):
        QuantOptions("int4", block_size=24)
    with pytest.raises(SpecrtError, match="int8, int4"):
        QuantOptions("int2")


@pytest.mark.slow
def test_gguf_blocks_carry_the_default_models_weights_exactly(default_target, tmp_path):
    """--weights gguf on the Q4_1 default: every MatMul becomes MatMulNBits holding the GGUF's own blocks,
    so with float activations (accuracy level 0) the engine computes what the fp32 torch model computes."""
    from specrt.export.export import export_engine
    from specrt.export.quantize import QuantOptions
    from specrt.runtime.backends.torch_backend import TorchTargetEngine
    from specrt.runtime.engine import causal_mask

    folder = export_engine("none", out=tmp_path / "gguf", quiet=True, loaded_target=default_target,
                           quant=QuantOptions("gguf", accuracy_level=0), ort_fused=False)  # only target.onnx is read
    model = onnx.load(str(folder / "target.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 211 and "Gemm" not in ops  # 30 layers x 7 + the tied head (Q8_0)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["export"]["weights"]["bits"] == "gguf"
    ids = torch.tensor([default_target.tokenizer.encode_chat("Why is the sky blue?")])
    t = ids.shape[1]
    pipe = Pipeline.from_engines(folder, drafter="none")
    engine = pipe.engine_for(t + 1)
    engine.set_taps(())
    engine.reset(1)
    got = engine.forward(ids, torch.arange(t)[None], causal_mask(1, t))[0]
    torch_model = default_target.model
    torch_model.set_taps(())
    want = TorchTargetEngine(torch_model, t + 8).forward(ids, torch.arange(t)[None], causal_mask(1, t))[0]
    assert (got - want).abs().max() < 2e-3 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
