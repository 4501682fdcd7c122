"""--weights w8a8 (specrt.export.integer_matmul): int8 weights x per-token int8 activations in integer
MatMuls. The rewrite against a numpy reference, the graphs it writes, and lossless speculation:
linear layers whose rows are independent and whose sums are exact, run with two-row decoding so
attention sums alike in decode and verify steps."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from _onnx_tiny import TARGET_CFG, last_logits, make_drafters, make_sharp_target, write_hf_target
from specrt.export.checkpoints.drafters import save_drafter
from specrt.plugins.errors import SpecrtError
from specrt.tools.cli_export import main as export_main
from specrt.export.integer_matmul import integer_matmuls, quantize_columns
from specrt.export.quantize import QuantOptions
from specrt.runtime.pipeline import Pipeline

ort = pytest.importorskip("onnxruntime")
FUSED_CFG = TARGET_CFG.__class__(**{**TARGET_CFG.__dict__, "hidden_size": 64, "head_dim": 16})
PROMPTS = [[5, 9, 23, 7], [3, 44, 12, 60, 8, 31, 2]]


def one_matmul_model(weight: np.ndarray, contrib: bool):
    from onnx import TensorProto, helper, numpy_helper

    k, n = weight.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", n])],
                              [numpy_helper.from_array(weight, "w")])
    opsets = [helper.make_opsetid("", 20)] + ([helper.make_opsetid("com.microsoft", 1)] if contrib else [])
    model = helper.make_model(graph, opset_imports=opsets)
    assert integer_matmuls(model) == 1
    return model


def reference(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The same arithmetic in numpy: per-row scale, round half to even, exact integer sums."""
    wq, ws = quantize_columns(weight)
    peak = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-12))
    xq = np.rint((x / peak) / np.float32(1 / 127)).astype(np.int64)  # as QuantizeLinear divides
    return (xq @ wq.astype(np.int64)).astype(np.float32) * (ws / np.float32(127)) * peak


@pytest.mark.parametrize("contrib", [True, False])
def test_the_rewrite_computes_per_token_int8_products(contrib):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((48, 24)).astype(np.float32)
    model = one_matmul_model(weight, contrib)
    ops = [n.op_type for n in model.graph.node]
    assert ("MatMulIntegerToFloat" in ops) == contrib and ("MatMulInteger" in ops) != contrib
    assert "MatMul" not in ops and "DynamicQuantizeLinear" not in ops  # per-tensor scales would mix rows
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, 5, 48)).astype(np.float32) * np.array([1, 30, 0.01, 5, 1], np.float32)[None, :, None]
    x[1, 2] = 0.0  # an all-zero token: a finite scale, zero output
    got = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, reference(x, weight), rtol=1e-5, atol=1e-5)
    assert np.all(got[1, 2] == 0)
    close = np.abs(got - x @ weight).max() / np.abs(x @ weight).max()
    assert close < 0.03  # int8 x int8 rounding, not a wrong product
    # a token's output depends on that token alone, bit for bit: alone, or among loud neighbours
    alone = sess.run(None, {"x": x[:1, 3:4]})[0]
    assert np.array_equal(alone[0, 0], got[0, 3])


def test_quantize_columns_is_symmetric_per_column():
    w = np.array([[1.0, -0.5], [-2.0, 0.25], [0.5, 0.0]], np.float32)
    q, s = quantize_columns(w)
    assert q.dtype == np.int8 and s.shape == (2,)
    assert q[:, 0].tolist() == [64, -127, 32] and np.isclose(s[0], 2.0 / 127)
    assert np.abs(q * s - w).max() <= s.max() / 2 + 1e-7
    assert quantize_columns(np.zeros((3, 1), np.float32))[1][0] == 1.0  # an all-zero column stays zero


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("w8a8")
    target = make_sharp_target(FUSED_CFG)
    write_hf_target(root / "tiny", target)
    save_drafter(make_drafters(target)["eagle3"], root / "ckpt", dtype=torch.float32)
    base = ["--drafter", "eagle3", "--target", str(root / "tiny"), "--drafter-ckpt", str(root / "ckpt"), "--quiet"]
    assert export_main(base + ["--out", str(root / "fp32")]) == 0
    assert export_main(base + ["--out", str(root / "w8a8"), "--weights", "w8a8"]) == 0
    return root


def test_w8a8_engines_hold_integer_matmuls_and_say_so(engines):
    manifest = json.loads((engines / "w8a8" / "manifest.json").read_text())
    weights = manifest["export"]["weights"]
    assert weights["weights"] == "w8a8" and weights["op"] == "MatMulInteger" and weights["bits"] == 8
    assert weights["activations"] == "int8 per token"
    for name, op in (("target_ort", "MatMulIntegerToFloat"), ("target", "MatMulInteger"),
                     ("eagle3_step", "MatMulInteger")):
        graph = onnx.load(str(engines / "w8a8" / f"{name}.onnx"), load_external_data=False).graph
        inits = {i.name for i in graph.initializer}
        ops = [n.op_type for n in graph.node]
        assert op in ops, name
        assert not [n for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in inits], name
    # the portable graph stays standard ONNX (no com.microsoft op): it must run anywhere ONNX runs
    portable = onnx.load(str(engines / "w8a8" / "target.onnx"), load_external_data=False)
    assert all(n.domain != "com.microsoft" for n in portable.graph.node)
    from specrt.tools.bench import weights_suffix

    assert weights_suffix(manifest) == "@w8a8"


def test_w8a8_engines_decode_bitwise_like_verify_steps(engines):
    """Per-token int8 rounding amplifies attention's float differences between one-row and multi-row
    calls (SmolLM2: 2/24 MT-bench outputs identical over 128 tokens without care, 24/24 with), so
    these engines get the int8-activation treatment: two-row decoding and chains."""
    pipe = Pipeline.from_engines(engines / "w8a8", threads=1)
    model = pipe.model
    assert model.fused is not None and model.two_row_decode and pipe.proposer.top_k == 1
    # and without a drafter too: plain decoding (one row, two attention rows) gives the text speculation
    # reproduces
    plain = Pipeline.from_engines(engines / "w8a8", threads=1, drafter="none")
    assert plain.model.attention_row_decode and not plain.model.two_row_decode
    assert plain.generate_ids(PROMPTS[:1], 24).tokens == pipe.generate_ids(PROMPTS[:1], 24).tokens
    ids = [5, 9, 23, 7, 11, 40, 2, 18, 33, 61]
    one, many = last_logits(model, ids, 1), last_logits(model, ids, 100)
    assert torch.equal(one, many) and torch.equal(last_logits(plain.model, ids, 1), many)
    fp32 = Pipeline.from_engines(engines / "fp32", threads=1).model
    assert float(torch.nn.functional.cosine_similarity(one, last_logits(fp32, ids, 1), dim=0)) > 0.99


def test_speculation_on_w8a8_is_lossless_against_its_own_plain_decoding(engines):
    pipe = Pipeline.from_engines(engines / "w8a8", threads=1)
    for prompt in PROMPTS:
        assert pipe.generate_ids([prompt], 24).tokens == pipe.generate_ids([prompt], 24, speculative=False).tokens
    lookup = Pipeline.from_engines(engines / "w8a8", threads=1, drafter="lookup")
    assert lookup.generate_ids(PROMPTS[:1], 24).tokens == pipe.generate_ids(PROMPTS[:1], 24, speculative=False).tokens


def test_w8a8_batches_compute_each_row_bitwise_as_alone(engines):
    """Batched calls of int8-activation engines run one fused call per row on its own real tokens, so a
    row's logits in a batch (padding and other rows beside it) equal its logits alone, bitwise; on the
    portable batched graph they differed, and int8 rounding turned that into other text (serving)."""
    from specrt.runtime.backends.ort_backend import OrtTargetEngine
    from specrt.runtime.engine import causal_mask

    pipe = Pipeline.from_engines(engines / "w8a8", threads=1, drafter="none")
    model = pipe.model
    assert model.per_row_batches
    steps = [PROMPTS, [[1, 2, 3], [4, 5]]]  # a prefill of unequal prompts, then unequal new tokens

    def run(rows: list[int]) -> list[torch.Tensor]:
        engine = OrtTargetEngine(model, 32, len(rows))
        out = []
        for step in steps:
            toks = [step[r] for r in rows]
            t = max(map(len, toks))
            ids = torch.tensor([x + [0] * (t - len(x)) for x in toks])
            positions = engine.lengths[:, None] + torch.arange(t)[None, :]
            logits, _ = engine.forward(ids, positions, causal_mask(len(rows), t, [len(x) for x in toks]))
            for b, x in enumerate(toks):
                engine.commit(b, range(len(x)))
                out.append(logits[b, :len(x)])
        return out

    batched = run([0, 1])
    alone = [run([r]) for r in (0, 1)]
    for r in (0, 1):
        assert torch.equal(batched[r], alone[r][0]) and torch.equal(batched[2 + r], alone[r][1])
    # --shared-batches: one portable call for the batch, whose rounding differs from the fused calls'
    from specrt.runtime.serving.loading import set_batch_mode

    set_batch_mode(pipe, shared=True)
    assert not model.per_row_batches
    shared = run([0, 1])
    assert not all(torch.equal(shared[i], alone[i % 2][i // 2]) for i in range(4))


def test_w8a8_serving_batches_give_each_request_its_text_alone(engines):
    from specrt.runtime.serving.batcher import Batcher, Request

    pipe = Pipeline.from_engines(engines / "w8a8", threads=1)
    prompts, max_new = PROMPTS + [[17], [40, 41, 42]], [20, 12, 16, 9]
    alone = [pipe.generate_ids([p], n).tokens[0] for p, n in zip(prompts, max_new)]
    batcher = Batcher(pipe.engine_for(64, 3), pipe.proposer, "fixed", None, pipe.config.eos_token_ids)
    assert batcher.cost == "packed"  # one call per row on its real tokens: no padding to charge
    requests = [Request(p, n) for p, n in zip(prompts, max_new)]
    for req in requests:
        batcher.add(req)
    batcher.run_until_done()
    assert [r.tokens for r in requests] == alone
    assert batcher.counters.draft_steps > 0 and batcher.free_rows == 3


def test_w8a8_serving_skips_idle_rows_inside_the_batch(engines):
    """On a per-row engine a row left idle below a running one costs no call: after the two lower
    requests finish, each step of the last one is exactly one fused call, and its text is its text alone."""
    from specrt.runtime.serving.batcher import Batcher, Request

    pipe = Pipeline.from_engines(engines / "w8a8", threads=1)
    prompts, max_new = PROMPTS + [[40, 41, 42]], [2, 3, 24]
    alone = [pipe.generate_ids([p], n).tokens[0] for p, n in zip(prompts, max_new)]
    batcher = Batcher(pipe.engine_for(64, 3), pipe.proposer, "fixed", None, pipe.config.eos_token_ids)
    assert batcher.per_row
    requests = [Request(p, n) for p, n in zip(prompts, max_new)]
    for req in requests:
        batcher.add(req)
    while len(batcher.running) != 1 or not requests[2].tokens:
        batcher.step()
    assert sorted(batcher.running) == [2]  # rows 0 and 1 idle below it
    calls, steps = pipe.model.fused_calls, 0
    while not batcher.idle:
        batcher.step()
        steps += 1
    assert steps > 2 and pipe.model.fused_calls - calls == steps
    assert [r.tokens for r in requests] == alone


def test_w8a8_options_are_checked():
    opts = QuantOptions("w8a8", block_size=24, accuracy_level=4)  # block and level do not apply: reset
    assert (opts.block_size, opts.accuracy_level, opts.bits) == (0, 0, 8)
    with pytest.raises(SpecrtError, match="w8a8"):
        QuantOptions("int2")
