"""int4/int8 engines that keep a GGUF's own quantized weights, bit for bit (`--weights gguf`).

The embedded default ships as a Q4_1 GGUF: every linear weight is already 4-bit, in blocks of 32
along the input dim with a float16 scale d and minimum m (w = d*q + m, q in 0..15). Requantizing the
dequantized weights with a fresh RTN grid (`--weights int4`) rounds them a second time, and for a
135M model that second rounding costs a lot (docs/quant/quant.md). This module instead carries the
GGUF blocks into `com.microsoft::MatMulNBits` unchanged:

- Q4_0 (w = d*(q-8)): bits 4, scales d, the op's default zero point 8. Exact.
- Q8_0 (w = d*q, q int8): bits 8, stored as q+128 with the default zero point 128. Exact.
- Q4_1 (w = d*q + m): a float zero point would carry m exactly but falls to a ~50x slower kernel,
  and an explicit integer zero-point tensor changes results with the number of rows (see below), so
  the node holds d*(q-8) (the default zero point) and the rest goes in a correction:
  x.w = sum_b d_b ((q_b - 8) . x_b) + sum_b (m_b + 8 d_b) (1 . x_b), i.e. the MatMulNBits output plus
  (block sums of x) @ M^T, with M [N, K/32] the per-block offsets m + 8d. The block
  sums are computed once per input tensor and shared by the projections that read it (q/k/v,
  gate/up). Exact up to float summation order.

Other GGUF types (K-quants, F16/F32 tensors) are left to `--weights int4/int8`'s RTN path or kept in
float: the summary says which MatMuls were carried over and which were not.

Matching GGUF tensors to graph initializers: each quantized GGUF tensor is dequantized with gguf's
own `dequantize` (exactly what the loader put into the torch model), q/k rows unpermuted as the
loader does, transposed to the MatMul's [K, N] layout and hashed; the exported MatMul weights are
hashed the same way. Equal bytes identify the tensor without relying on exporter naming.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.plugins.errors import SpecrtError

BLOCK = 32


@dataclass
class GgufBlocks:
    """One GGUF weight [N, K] as blocks along K: codes [N, K] (uint8; Q8_0 already +128), scales
    [N, K/32], minima [N, K/32] (Q4_1) or None, bits."""

    name: str
    kind: str
    codes: np.ndarray
    scales: np.ndarray
    minima: np.ndarray | None
    bits: int


def _decode(raw: np.ndarray, kind: str, rows: int, cols: int) -> GgufBlocks:
    nb = cols // BLOCK
    blocks = raw.reshape(rows, nb, -1)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = blocks[..., 2:34].copy().view(np.int8).astype(np.int16)
        return GgufBlocks("", kind, (q + 128).astype(np.uint8).reshape(rows, cols), scales, None, 8)
    if kind == "Q4_1":
        minima = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:20]
    else:  # Q4_0
        minima, qs = None, blocks[..., 2:18]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element j low nibble, j+16 high nibble
    return GgufBlocks("", kind, codes.reshape(rows, cols).astype(np.uint8), scales, minima, 4)


def dequantize_blocks(b: GgufBlocks) -> np.ndarray:
    rows, cols = b.codes.shape
    q = b.codes.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32)
    if b.kind == "Q8_0":
        w = (q - 128.0) * b.scales[..., None]
    elif b.kind == "Q4_1":
        w = q * b.scales[..., None] + b.minima[..., None]
    else:
        w = (q - 8.0) * b.scales[..., None]
    return w.reshape(rows, cols)


def _weight_key(array: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def read_gguf_blocks(path: str | Path) -> dict[str, GgufBlocks]:
    """Blocks of every Q4_0/Q4_1/Q8_0 2-D tensor, keyed by the hash of its [K, N] float32 transpose as
    the exported graph stores it (after the loader's q/k row unpermutation)."""
    from gguf.quants import dequantize

    from specrt.export.checkpoints.gguf_file import _unpermute_rope_rows, config_from_gguf, metadata, open_gguf

    reader = open_gguf(path)
    meta = metadata(reader)
    cfg = config_from_gguf(meta, str(path))
    permute = meta["general.architecture"] == "llama"
    out: dict[str, GgufBlocks] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in ("Q4_0", "Q4_1", "Q8_0") or len(tensor.shape) != 2:
            continue
        cols, rows = (int(d) for d in tensor.shape)  # ggml lists the fastest dim first
        blocks = _decode(np.asarray(tensor.data), kind, rows, cols)
        reference = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(rows, cols)
        if not np.array_equal(dequantize_blocks(blocks), reference):
            raise SpecrtError(f"{path}: decoding {tensor.name} ({kind}) disagrees with gguf's dequantize",
                              "this is a bug in specrt.export.gguf_quant: please report it with the file")
        name = tensor.name
        if permute and name.endswith("attn_q.weight"):
            perm = lambda a: _unpermute_rope_rows(a, cfg.num_heads)  # noqa: E731
        elif permute and name.endswith("attn_k.weight"):
            perm = lambda a: _unpermute_rope_rows(a, cfg.num_kv_heads)  # noqa: E731
        else:
            perm = lambda a: a  # noqa: E731
        blocks = GgufBlocks(name, kind, perm(blocks.codes), perm(blocks.scales),
                            None if blocks.minima is None else perm(blocks.minima), blocks.bits)
        out[_weight_key(perm(reference).T)] = blocks
    return out


def _rank_of(model, name: str) -> int | None:
    for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            return len(vi.type.tensor_type.shape.dim)
    return None


def _concatenated_blocks(node, weight: np.ndarray, blocks: dict[str, GgufBlocks]) -> GgufBlocks | None:
    """Blocks of a fused projection (q|k|v, gate|up: `specrt.export.ort_fused`), whose MatMul weight
    is several GGUF tensors side by side along N; the node's `specrt.parts` gives their widths."""
    widths = next((p.value for p in node.metadata_props if p.key == "specrt.parts"), None)
    if widths is None:
        return None
    edges = np.cumsum([0] + [int(w) for w in widths.split(",")])
    if edges[-1] != weight.shape[1]:
        return None
    parts = [blocks.get(_weight_key(weight[:, a:b])) for a, b in zip(edges[:-1], edges[1:])]
    if any(p is None for p in parts) or len({(p.kind, p.bits) for p in parts}) != 1:
        return None  # a part is missing or the parts mix formats: leave the MatMul to other passes
    first = parts[0]
    minima = None if first.minima is None else np.concatenate([p.minima for p in parts], axis=0)
    return GgufBlocks("|".join(p.name for p in parts), first.kind, np.concatenate([p.codes for p in parts], axis=0),
                      np.concatenate([p.scales for p in parts], axis=0), minima, first.bits)


def carry_gguf_blocks(model, blocks: dict[str, GgufBlocks], accuracy_level: int = 4) -> dict:
    """Replace every MatMul whose constant B matches a GGUF tensor by MatMulNBits (+ Q4_1 correction)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.shape_inference.infer_shapes(model)
    inits = {i.name: i for i in model.graph.initializer}
    new_nodes, new_inits = [], []
    block_sums: dict[str, str] = {}  # input tensor -> its block-sum tensor (shared by q/k/v, gate/up)
    carried, skipped = 0, 0
    for node in model.graph.node:
        b = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if b is None or len(b.dims) != 2:
            new_nodes.append(node)
            continue
        weight = numpy_helper.to_array(b)
        found = blocks.get(_weight_key(weight)) or _concatenated_blocks(node, weight, blocks)
        if found is None:
            skipped += 1
            new_nodes.append(node)
            continue
        k, n = weight.shape
        nb = k // BLOCK
        base = f"{b.name}__gguf"
        codes = found.codes.reshape(n, nb, BLOCK)
        if found.bits == 4:
            packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # [N, nb, 16]
        else:
            packed = codes.astype(np.uint8)  # [N, nb, 32]
        new_inits += [numpy_helper.from_array(packed, f"{base}_q"),
                      numpy_helper.from_array(found.scales.reshape(-1).astype(np.float32), f"{base}_scales")]
        # no zero-point input: the op's default (8 for 4 bits) keeps MatMulNBits on its symmetric kernel,
        # whose results for one row do not depend on how many rows are in the call. With an explicit
        # zero-point tensor ORT 1.32 runs M = 1 and M > 1 through different paths whose logits differ by
        # ~1, so a speculative verify step (M > 1) would disagree with plain decoding (M = 1).
        inputs = [node.input[0], f"{base}_q", f"{base}_scales"]
        out = node.output[0]
        nbits_out = f"{base}_y" if found.kind == "Q4_1" else out
        new_nodes.append(helper.make_node("MatMulNBits", inputs, [nbits_out], name=f"{base}_matmul",
                                          domain="com.microsoft", K=k, N=n, bits=found.bits, block_size=BLOCK,
                                          accuracy_level=accuracy_level))
        if found.kind == "Q4_1":
            x = node.input[0]
            if x not in block_sums:
                rank = _rank_of(model, x)
                if rank is None:
                    raise SpecrtError(f"the rank of {x} is unknown", "this is a bug in specrt.export.gguf_quant")
                shape = np.array([0] * (rank - 1) + [nb, BLOCK], dtype=np.int64)
                new_inits.append(numpy_helper.from_array(shape, f"{x}__blockshape"))
                new_inits.append(numpy_helper.from_array(np.array([-1], np.int64), f"{x}__lastaxis"))
                new_nodes.append(helper.make_node("Reshape", [x, f"{x}__blockshape"], [f"{x}__blocks"]))
                new_nodes.append(helper.make_node("ReduceSum", [f"{x}__blocks", f"{x}__lastaxis"], [f"{x}__blocksum"],
                                                  keepdims=0))
                block_sums[x] = f"{x}__blocksum"
            # w = d*q + m = d*(q - 8) + (m + 8d): the node applies the default zero point 8, the
            # correction adds m + 8d per block (8d is exact; fp16 d and m sum exactly in float32)
            offsets = found.minima + 8.0 * found.scales
            new_inits.append(numpy_helper.from_array(np.ascontiguousarray(offsets.T.astype(np.float32)), f"{base}_minima"))
            new_nodes.append(helper.make_node("MatMul", [block_sums[x], f"{base}_minima"], [f"{base}_corr"]))
            new_nodes.append(helper.make_node("Add", [nbits_out, f"{base}_corr"], [out]))
        carried += 1
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    model.graph.initializer.extend(new_inits)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return {"model": model, "carried": carried, "not_in_gguf": skipped}
