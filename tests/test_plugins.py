"""The specrt custom ops: ONNX function bodies (run by ONNX Runtime) against their torch references."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper

from specrt.export.models.layers import masked_attention
from specrt.plugins import onnx_ops
from specrt.plugins.confidence_truncate import (
    THRESHOLD_ONLY, confidence_truncate_reference, sps_vector, survival_reference,
)
from specrt.plugins.tree_attention import tree_attention_reference

ort = pytest.importorskip("onnxruntime")

V = helper.make_tensor_value_info


def session(model):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def tree_attention_model(opset: int = 20, elem=TP.FLOAT, scale: float = 0.125):
    inputs = [
        V("query", elem, ["B", "Hq", "T", "D"]), V("key", elem, ["B", "Hkv", "T", "D"]),
        V("value", elem, ["B", "Hkv", "T", "D"]), V("past_key", elem, ["B", "Hkv", "C", "D"]),
        V("past_value", elem, ["B", "Hkv", "C", "D"]), V("past_mask", TP.BOOL, ["B", "T", "S"]),
        V("tree_mask", TP.BOOL, ["B", "T", "T"]),
    ]
    return onnx_ops.single_op_model("TreeAttention", inputs, [V("output", elem, ["B", "Hq", "T", "D"])],
                                    {"scale": scale}, opset)


def confidence_model(opset: int = 20):
    inputs = [V("conf_logits", TP.FLOAT, ["B", "K"]), V("temperatures", TP.FLOAT, ["Kt"]),
              V("threshold", TP.FLOAT, []), V("sps", TP.FLOAT, ["M"])]
    outputs = [V("survival", TP.FLOAT, ["B", "K"]), V("draft_length", TP.INT64, ["B"])]
    return onnx_ops.single_op_model("ConfidenceTruncate", inputs, outputs, None, opset)


def random_tree(g: torch.Generator, batch: int, t: int) -> torch.Tensor:
    mask = torch.zeros(batch, t, t, dtype=torch.bool)
    for b in range(batch):
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, t)]
        for i, p in enumerate(parents):
            mask[b, i, i] = True
            while p >= 0:
                mask[b, i, p] = True
                p = parents[p]
    return mask


@pytest.fixture(scope="module")
def attention_session():
    return session(tree_attention_model())


@pytest.mark.parametrize("case", range(8))
def test_tree_attention_body_matches_reference(attention_session, case):
    g = torch.Generator().manual_seed(case)
    hkv = [1, 2, 3][case % 3]
    group = [1, 2, 4][(case // 3) % 3]
    b, t, d = 1 + case % 3, 1 + (case * 5) % 7, 8
    capacity = 12
    window = [0, 3, 12, 7][case % 4]  # 0: prefill with an empty cache; 12: the whole cache
    q = torch.randn(b, hkv * group, t, d, generator=g)
    k, v = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    pk, pv = torch.randn(b, hkv, capacity, d, generator=g), torch.randn(b, hkv, capacity, d, generator=g)
    lengths = torch.randint(0, window + 1, (b,), generator=g)
    past_mask = (torch.arange(window)[None, None, :] < lengths[:, None, None]).expand(b, t, window).clone()
    tree = random_tree(g, b, t)
    args = (q, k, v, pk, pv, past_mask, tree)
    ref = tree_attention_reference(*args, scale=0.125)
    (out,) = attention_session.run(None, {n: a.numpy() for n, a in zip(
        ("query", "key", "value", "past_key", "past_value", "past_mask", "tree_mask"), args)})
    assert np.abs(out - ref.numpy()).max() <= 1e-5
    # the torch custom op is the reference, and equals the models' SDPA attention on valid masks
    assert torch.equal(torch.ops.specrt.tree_attention(*args, 0.125), ref)
    full_k = torch.cat([pk[:, :, :window], k], 2)
    full_v = torch.cat([pv[:, :, :window], v], 2)
    sdpa = masked_attention(q * (0.125 * d ** 0.5), full_k, full_v, torch.cat([past_mask, tree], -1))
    assert (sdpa - ref).abs().max() <= 1e-5


def test_tree_attention_fully_masked_row_is_zero_not_nan(attention_session):
    b, t, d = 1, 3, 4
    args = [torch.randn(b, 2, t, d), torch.randn(b, 1, t, d), torch.randn(b, 1, t, d),
            torch.randn(b, 1, 5, d), torch.randn(b, 1, 5, d), torch.zeros(b, t, 5, dtype=torch.bool),
            torch.eye(t, dtype=torch.bool)[None].clone()]
    args[6][0, 1, 1] = False  # row 1 sees nothing at all
    ref = tree_attention_reference(*args, scale=0.5)
    (out,) = attention_session.run(None, {n: a.numpy() for n, a in zip(
        ("query", "key", "value", "past_key", "past_value", "past_mask", "tree_mask"), args)})
    assert np.isfinite(out).all() and np.abs(out[0, :, 1]).max() == 0.0
    assert np.abs(out - ref.numpy()).max() <= 1e-6


def test_tree_attention_float16_body_computes_in_float32():
    sess = session(tree_attention_model(elem=TP.FLOAT16, scale=0.25))
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(2, 4, 3, 8, generator=g).half(), torch.randn(2, 2, 3, 8, generator=g).half(),
            torch.randn(2, 2, 3, 8, generator=g).half(), torch.randn(2, 2, 6, 8, generator=g).half(),
            torch.randn(2, 2, 6, 8, generator=g).half(), torch.ones(2, 3, 4, dtype=torch.bool),
            torch.tril(torch.ones(3, 3, dtype=torch.bool)).expand(2, 3, 3).clone()]
    (out,) = sess.run(None, {n: a.numpy() for n, a in zip(
        ("query", "key", "value", "past_key", "past_value", "past_mask", "tree_mask"), args)})
    assert out.dtype == np.float16
    assert np.abs(out.astype(np.float32) - tree_attention_reference(*args, scale=0.25).float().numpy()).max() < 2e-3


@pytest.fixture(scope="module")
def confidence_session():
    return session(confidence_model())


def _run_conf(sess, z, temps, threshold, sps):
    s, n = sess.run(None, {"conf_logits": z.numpy(), "temperatures": temps.numpy(),
                            "threshold": np.array(threshold, np.float32), "sps": sps.numpy()})
    return s, n


@pytest.mark.parametrize("case", range(12))
def test_confidence_truncate_body_matches_reference(confidence_session, case):
    g = torch.Generator().manual_seed(100 + case)
    b, k = 1 + case % 4, 1 + (case * 3) % 7
    z = torch.randn(b, k, generator=g) * 3 + 1.5
    temps = torch.rand(k + 2, generator=g) + 0.5  # longer than K: the first K are used
    threshold = [0.0, 0.2, 0.5][case % 3]

    def curve(n: int) -> float:  # concave or sharply falling: both make the early stop matter
        return 100.0 / (1 + 0.3 * n) if case % 2 else 100.0 / (1 + 0.01 * n * n)

    for sps in (THRESHOLD_ONLY, sps_vector(curve, b * (k + 1))):
        s_ref, n_ref = confidence_truncate_reference(z, temps, torch.tensor(threshold), sps)
        s, n = _run_conf(confidence_session, z, temps, threshold, sps)
        assert np.abs(s - s_ref.numpy()).max() <= 1e-6
        assert n.tolist() == n_ref.tolist()
        assert (n <= k).all() and (n >= 0).all()


def test_survival_is_the_calibrated_product():
    z = torch.tensor([[2.0, -1.0, 0.5], [0.0, 3.0, -4.0]])
    temps = torch.tensor([1.0, 2.0, 0.5])
    expected = torch.cumprod(torch.sigmoid(z / temps), dim=-1)
    assert torch.allclose(survival_reference(z, temps), expected, atol=1e-7)


def test_threshold_policy_is_the_proposers_rule(confidence_session):
    g = torch.Generator().manual_seed(7)
    z = torch.randn(5, 6, generator=g) * 2 + 2
    temps = torch.ones(6)
    for threshold in (0.0, 0.3, 0.6, 0.95):
        survival = survival_reference(z, temps)
        rule = (survival >= threshold).long().cumprod(dim=-1).sum(dim=-1)  # BlockProposer's truncation
        _, n = _run_conf(confidence_session, z, temps, threshold, THRESHOLD_ONLY)
        assert n.tolist() == rule.tolist()


def test_sps_policy_is_algorithm_1_with_early_stop(confidence_session):
    """Same lengths as the runtime's scheduler (paper Algorithm 1), ties included."""
    from specrt.runtime.scheduler import schedule

    g = torch.Generator().manual_seed(11)
    for trial in range(10):
        b, k = 1 + trial % 4, 3 + trial % 4
        z = torch.randn(b, k, generator=g) * 2 + 1
        if trial % 3 == 0:
            z[:] = z[0:1]  # identical rows: ties across requests
        temps = torch.rand(k, generator=g) + 0.7
        max_tokens = b * (k + 1)

        def curve(n: int) -> float:
            return 50.0 / (1 + 0.02 * n * n) if trial % 2 else 50.0 * (1.0 if n < 4 else 0.6 - 0.01 * n)

        survival, n = _run_conf(confidence_session, z, temps, 0.0, sps_vector(curve, max_tokens))
        expected = schedule(survival.astype(np.float64).tolist(), curve, max_tokens=max_tokens)
        assert n.tolist() == expected.lengths


def test_function_bodies_are_standard_ops_for_every_supported_opset():
    for opset in (onnx_ops.MIN_OPSET, 20, onnx_ops.MAX_OPSET):
        for name in onnx_ops.OP_MODULES:
            fn = onnx_ops.function_proto(name, opset)
            assert fn.domain == "specrt" and fn.name == name
            assert {n.domain for n in fn.node} <= {"", "ai.onnx"}
            assert [(o.domain, o.version) for o in fn.opset_import] == [("", opset)]
    model = tree_attention_model(opset=onnx_ops.MIN_OPSET)
    assert onnx_ops.audit_domains(model) == []
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    session(model)  # ORT accepts the oldest supported opset too
    with pytest.raises(Exception, match="opset"):
        onnx_ops.check_opset(17)


def test_schemas_are_registered_only_while_exporting():
    assert not onnx.defs.has("TreeAttention", "specrt")
    with onnx_ops.registered_schemas():
        assert onnx.defs.has("TreeAttention", "specrt") and onnx.defs.has("ConfidenceTruncate", "specrt")
    assert not onnx.defs.has("TreeAttention", "specrt") and not onnx.defs.has("ConfidenceTruncate", "specrt")


def test_audit_flags_foreign_ops():
    model = confidence_model()
    model.graph.node.append(helper.make_node("GroupQueryAttention", ["x"], ["y"], domain="com.microsoft"))
    problems = onnx_ops.audit_domains(model)
    assert problems and "com.microsoft::GroupQueryAttention" in problems[0]
    del model.functions[:]
    assert any("ConfidenceTruncate" in p for p in onnx_ops.audit_domains(model))
