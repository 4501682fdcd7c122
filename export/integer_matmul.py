"""int8 weights x per-token int8 activations, multiplied in integers: `specrt export --weights w8a8`.

Why. On a CPU a verify step of T tokens costs more than a decode step as soon as the weights stop
dominating, and with MatMulNBits (int4/int8, `quantize.py`) that happens early: here each extra
verified row costs ~1.7 ms against a ~6.4 ms int4 decode step (27%), fp32 SGEMM ~1.25 ms of ~25 ms.
Speculation lives on cheap rows. ONNX Runtime's `MatMulInteger` (uint8 x int8 -> int32) runs on
MLAS's quantized GEMM, which uses AMX tiles / AVX-512 VNNI where the CPU has them: on this
machine's Sapphire Rapids cores a stack shaped like SmolLM2's 121 linear layers takes 6.8 ms for one
row and 12.1 ms for sixteen (MatMulNBits int4: 36 ms for sixteen). Verifying a long copy then costs
about what decoding one token does.

Row-independent linear layers. Every activation row is quantized on its own (one scale per token:
max |x| / 127), the products are summed in int32, which is exact in any order, and the rescale is
elementwise. So a linear layer's output for token i depends on token i alone, never on how many rows
the call holds or how the kernel tiles them. Per-tensor dynamic quantization (`DynamicQuantizeMatMul`)
is a little faster and is not used: its scale mixes the rows of a call. What is left between a
verify step and decoding is the float attention (GroupQueryAttention's one-row loop sums in another
order, ~1e-6), and the per-token rounding amplifies it as MatMulNBits' int8 activations do: measured
on SmolLM2, speculative greedy output equalled plain decoding on 2/24 MT-bench prompts (128 tokens)
with trees and one-row decoding, 24/24 with two-row decoding and chains. So the runtime treats these
engines as int8-activation engines (`ort_backend.load_engines`), where a second decode row costs
~0.5-1 ms here instead of int4's ~2.

What the rewrite emits, per MatMul whose B is a constant [K, N] initializer (the LM head too, after
`quantize.gemm_heads_to_matmul`):
    m  = max(ReduceMax(|x|, last axis), tiny)                    one per token, shared by every
    qx = QuantizeLinear(x / m, scale 1/127, zero point 128)       MatMul reading the same x (uint8)
    y  = MatMulIntegerToFloat(qx, Wq, 1, w_scale / 127, 128) * m (com.microsoft: int32 sums * scale)
with Wq = round(W / w_scale) per output column (symmetric, w_scale = max |W[:, n]| / 127). Norms,
RoPE, attention and the K/V cache stay fp32. The quality report (`tools/quant_report.py`) measures
what the rounding costs against fp32.
"""

from __future__ import annotations

import numpy as np

ACTIVATION_ZERO_POINT = 128  # uint8 activations: MLAS's fast kernels are uint8 x int8 (int8 x int8 is slow here)
_TINY = 1e-12  # an all-zero row still gets a finite scale


def quantize_columns(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 weight, float32 scale per column) with weight ~ int8 * scale, symmetric per output column."""
    w = np.asarray(weight, dtype=np.float32)
    scale = np.abs(w).max(axis=0) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def uses_contrib_ops(model) -> bool:
    """Whether the graph already needs ONNX Runtime (the ORT-fused target graph): then the fused
    com.microsoft op may be used; a portable graph keeps to standard ONNX."""
    return any(o.domain == "com.microsoft" for o in model.opset_import)


def integer_matmuls(model, contrib_ops: bool | None = None) -> int:
    """Rewrite every constant-weight MatMul of `model` (in place) as described in the module
    docstring; returns how many were rewritten. Opset >= 18 (ReduceMax takes axes as an input).

    contrib_ops (default: `uses_contrib_ops(model)`): MatMulIntegerToFloat; else the standard
    MatMulInteger -> Cast -> Mul(w_scale / 127), the same numbers in two more kernels."""
    from onnx import TensorProto, helper, numpy_helper

    if contrib_ops is None:
        contrib_ops = uses_contrib_ops(model)

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consts = {
        "w8a8_axes": numpy_helper.from_array(np.array([-1], dtype=np.int64), "w8a8_axes"),
        "w8a8_inv127": numpy_helper.from_array(np.array(1.0 / 127.0, dtype=np.float32), "w8a8_inv127"),
        "w8a8_tiny": numpy_helper.from_array(np.array(_TINY, dtype=np.float32), "w8a8_tiny"),
        "w8a8_one": numpy_helper.from_array(np.array(1.0, dtype=np.float32), "w8a8_one"),
        "w8a8_zero_point": numpy_helper.from_array(np.array(ACTIVATION_ZERO_POINT, dtype=np.uint8), "w8a8_zero_point"),
    }
    quantized_inputs: dict[str, tuple[str, str]] = {}  # activation name -> (uint8 rows, per-row scale)
    new_nodes = []
    count = 0

    def quantize_rows(x: str) -> tuple[str, str]:
        if x not in quantized_inputs:
            p = f"{x}__w8a8_"
            new_nodes.extend([
                helper.make_node("Abs", [x], [p + "abs"], name=p + "abs"),
                helper.make_node("ReduceMax", [p + "abs", "w8a8_axes"], [p + "amax"], name=p + "amax", keepdims=1),
                helper.make_node("Max", [p + "amax", "w8a8_tiny"], [p + "scale"], name=p + "scale"),
                helper.make_node("Div", [x, p + "scale"], [p + "unit"], name=p + "unit"),  # in [-1, 1]
                # * 127, round half to even, + 128, saturate to uint8: one QuantizeLinear (scale 1/127);
                # the 1/127 of the way back is folded into the column scales
                helper.make_node("QuantizeLinear", [p + "unit", "w8a8_inv127", "w8a8_zero_point"], [p + "q"], name=p + "q"),
            ])
            quantized_inputs[x] = (p + "q", p + "scale")
        return quantized_inputs[x]

    for node in list(graph.node):
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2:
            new_nodes.append(node)
            continue
        q, scale = quantize_columns(numpy_helper.to_array(weight))
        scale = (scale / np.float32(127.0)).astype(np.float32)  # the activations' 1/127 (quantize_rows)
        wq_name, ws_name = f"{weight.name}__w8a8_int8", f"{weight.name}__w8a8_scale"
        if wq_name not in inits:
            inits[wq_name] = numpy_helper.from_array(q, wq_name)
            inits[ws_name] = numpy_helper.from_array(scale, ws_name)
            graph.initializer.extend([inits[wq_name], inits[ws_name]])
        qx, row_scale = quantize_rows(node.input[0])
        out = node.output[0]
        p = f"{out}__w8a8_"
        if contrib_ops:
            # uint8 x int8 in int32, times the column scales, in one kernel (MLAS's quantized GEMM)
            new_nodes.append(helper.make_node("MatMulIntegerToFloat", [qx, wq_name, "w8a8_one", ws_name, "w8a8_zero_point"],
                                              [p + "cols"], name=p + "matmul", domain="com.microsoft"))
        else:
            new_nodes.extend([
                helper.make_node("MatMulInteger", [qx, wq_name, "w8a8_zero_point"], [p + "acc"], name=p + "matmul"),
                helper.make_node("Cast", [p + "acc"], [p + "accf"], name=p + "cast", to=TensorProto.FLOAT),
                helper.make_node("Mul", [p + "accf", ws_name], [p + "cols"], name=p + "cols"),
            ])
        new_nodes.append(helper.make_node("Mul", [p + "cols", row_scale], [out], name=p + "rows"))
        count += 1
    if count:
        del graph.node[:]
        graph.node.extend(new_nodes)
        graph.initializer.extend(c for name, c in consts.items() if name not in inits)
    return count
