"""Weight-only quantization of exported graphs with ONNX Runtime's own quantizer (MatMulNBits).

    specrt export --drafter dspark --weights int4 [--quant-block 32] [--quant-asymmetric] [--no-quant-lm-head]

Why weight-only, and why MatMulNBits: on a CPU, decoding a small model is memory-bound (the fp32
SmolLM2-135M reads ~540 MB of weights per token). `onnxruntime.quantization.matmul_nbits_quantizer`
rewrites every MatMul whose B is a constant [K, N] initializer into `com.microsoft::MatMulNBits`
(4 or 8 bits per weight, one scale (and zero point when asymmetric) per block of `block_size` along
K). ORT's CPU kernels for it dequantize blocks on the fly, and with `accuracy_level=4` quantize the
activations to int8 and run int8 dot products: the fastest CPU path ORT has, and the one
onnxruntime-genai's int4 models use. Activations, norms, RoPE, attention and the K/V cache stay in
the export dtype, so "lossless" keeps its meaning against the quantized target: speculation
reproduces the quantized target's own greedy output exactly (docs/exactness.md).

The LM head: exported as Gemm(transB=1) on the [V, H] weight (so a head tied to the embedding is
stored once). The quantizer only takes MatMul, so with `lm_head=True` each such Gemm becomes a
MatMul on a transposed copy, which then quantizes (the embedding's Gather keeps the fp32 table).
At 49152 x 576 the head is a fifth of SmolLM2's weights and read for every verified row, so it is
where int4 pays most; the quality report (`tools/quant_report.py`) measures what it costs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specrt.plugins.errors import SpecrtError

WEIGHTS = ("fp32", "fp16", "int8", "int4", "w8a8", "gguf")


@dataclass
class QuantOptions:
    # int8 | int4 | gguf (the GGUF's own Q4_0/Q4_1/Q8_0 blocks, specrt.export.gguf_quant) | w8a8 (int8
    # weights per column and int8 activations per token in integer MatMuls, specrt.export.integer_matmul)
    weights: str = "int4"
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations x int8-unpacked weights (fastest on CPU)
    lm_head: bool = True

    def __post_init__(self) -> None:
        if self.weights not in ("int8", "int4", "w8a8", "gguf"):
            raise SpecrtError(f"quantization to {self.weights!r} is not supported",
                              "use --weights int8, int4, w8a8 or gguf")
        if self.weights == "w8a8":
            # one scale per output column, not per block; activations are quantized per token, in the graph
            self.block_size, self.symmetric, self.accuracy_level = 0, True, 0
            return
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise SpecrtError(f"--quant-block {self.block_size} is not a power of two >= 16",
                              "use 16, 32, 64 or 128 (32 is the usual choice for int4)")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise SpecrtError(f"accuracy level {self.accuracy_level} is outside 0..4", "use 4 (int8 compute) or 0")

    @property
    def bits(self) -> int | str:
        return {"int4": 4, "int8": 8, "w8a8": 8}.get(self.weights, "gguf")

    def to_dict(self) -> dict:
        if self.weights == "w8a8":
            return {**asdict(self), "bits": self.bits, "activations": "int8 per token", "op": "MatMulInteger",
                    "quantizer": "specrt.export.integer_matmul (RTN per output column)"}
        quantizer = ("the GGUF's own blocks (specrt.export.gguf_quant)" if self.weights == "gguf"
                     else "onnxruntime.quantization.matmul_nbits_quantizer (RTN)")
        return {**asdict(self), "bits": self.bits, "op": "com.microsoft::MatMulNBits", "quantizer": quantizer}


def gemm_heads_to_matmul(model) -> int:
    """Rewrite Gemm(A, B, transB=1) with a constant 2-D B and no bias into MatMul(A, B^T); returns the count."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    count = 0
    for node in model.graph.node:
        if node.op_type != "Gemm" or len(node.input) != 2 or node.input[1] not in inits:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transB", 0) != 1 or attrs.get("transA", 0) != 0 or attrs.get("alpha", 1.0) != 1.0:
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        transposed = numpy_helper.from_array(np.ascontiguousarray(weight.T), f"{node.input[1]}__T")
        model.graph.initializer.append(transposed)
        node.op_type = "MatMul"
        del node.attribute[:]
        node.input[1] = transposed.name
        count += 1
    return count


def fold_head_reshapes(model) -> int:
    """Drop the Reshapes the ORT-fused graph puts around its LM head (`ort_fused.HEAD_FLATTEN`) once the
    head is a MatMul/MatMulNBits, which takes the [batch, rows, hidden] rows as they are and yields the
    [batch, rows, vocab] logits directly. Returns the number of heads folded (0 on other graphs)."""
    from specrt.export.ort_fused import HEAD_FLATTEN, HEAD_UNFLATTEN

    def marked(key):
        return [n for n in model.graph.node if any(p.key == key for p in n.metadata_props)]

    folded = 0
    for flatten in marked(HEAD_FLATTEN):
        heads = [n for n in model.graph.node if n.input and n.input[0] == flatten.output[0]]
        if len(heads) != 1 or heads[0].op_type not in ("MatMul", "MatMulNBits"):
            continue  # still a 2-D Gemm (float head): the Reshapes are needed
        head = heads[0]
        unflatten = [n for n in marked(HEAD_UNFLATTEN) if n.input[0] == head.output[0]]
        if len(unflatten) != 1:
            continue
        head.input[0] = flatten.input[0]
        head.output[0] = unflatten[0].output[0]
        model.graph.node.remove(flatten)
        model.graph.node.remove(unflatten[0])
        folded += 1
    if folded:
        drop_dead_nodes(model)
    return folded


def drop_dead_nodes(model) -> None:
    """Remove nodes none of whose outputs is read (the logits shape computation a fold leaves behind)."""
    outputs = {o.name for o in model.graph.output}
    while True:
        used = {name for node in model.graph.node for name in node.input} | outputs
        dead = [n for n in model.graph.node if not any(o in used for o in n.output if o)]
        if not dead:
            return
        for node in dead:
            model.graph.node.remove(node)


def drop_unused_initializers(model) -> None:
    used = {name for node in model.graph.node for name in node.input}
    used |= {name for fn in model.functions for node in fn.node for name in node.input}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


def _part_marks(model) -> dict[str, str]:
    """output name -> the `specrt.parts` mark of the node computing it (the ORT-fused graph's packed
    projections: specrt.export.gguf_quant reads it, and specrt.export.shared_weights stores such a
    weight as its parts when another graph holds them)."""
    from specrt.export.shared_weights import PARTS_KEY

    return {node.output[0]: prop.value for node in model.graph.node for prop in node.metadata_props
            if prop.key == PARTS_KEY}


def _restore_part_marks(model, marks: dict[str, str]) -> None:
    """Mark the nodes that compute a marked output now (quantizers replace the MatMul and drop its marks)."""
    from specrt.export.shared_weights import PARTS_KEY

    for node in model.graph.node:
        if node.output and node.output[0] in marks and not any(p.key == PARTS_KEY for p in node.metadata_props):
            entry = node.metadata_props.add()
            entry.key, entry.value = PARTS_KEY, marks[node.output[0]]


def quantize_graph(path: Path, options: QuantOptions, external_data: bool, gguf_blocks: dict | None = None) -> dict:
    """Quantize one graph file in place (its external data file is rewritten too). Returns a summary."""
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from specrt.export.onnx_export import save_onnx

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # it logs every skipped node

    path = Path(path)
    model = onnx.load(str(path), load_external_data=True)
    parts = _part_marks(model)
    heads = gemm_heads_to_matmul(model) if options.lm_head else 0
    matmuls = sum(1 for n in model.graph.node if n.op_type == "MatMul")
    if options.weights == "w8a8":
        from specrt.export.integer_matmul import integer_matmuls

        fold_head_reshapes(model)  # while the head is still a plain MatMul (it takes the 3-D rows as they are)
        quantized, op = integer_matmuls(model), "MatMulInteger"
    else:
        if options.weights == "gguf":
            from specrt.export.gguf_quant import carry_gguf_blocks

            model = carry_gguf_blocks(model, gguf_blocks or {}, options.accuracy_level)["model"]
        else:
            config = DefaultWeightOnlyQuantConfig(block_size=options.block_size, is_symmetric=options.symmetric,
                                                  accuracy_level=options.accuracy_level, bits=options.bits)
            quantizer = MatMulNBitsQuantizer(model, bits=options.bits, block_size=options.block_size,
                                             is_symmetric=options.symmetric, accuracy_level=options.accuracy_level,
                                             algo_config=config)
            quantizer.process()
            model = quantizer.model.model
        fold_head_reshapes(model)  # the fused graph's head is a MatMulNBits now
        quantized, op = sum(1 for n in model.graph.node if n.op_type == "MatMulNBits"), "MatMulNBits"
    _restore_part_marks(model, parts)
    drop_unused_initializers(model)
    if quantized == 0 and options.weights != "gguf":  # a drafter graph may hold no GGUF tensor at all
        raise SpecrtError(f"{path.name}: no MatMul could be quantized", "this graph has no constant-weight MatMul")
    save_onnx(model, path, external_data)
    return {"matmuls": matmuls, "quantized": quantized, "lm_heads": heads, "op": op}

