"""The target as ONNX Runtime's fused contrib ops: the CPU/GPU fast path of the ORT backend.

Why a second target graph: the portable `target` graph (`specrt.export.onnx_export`) uses only
standard ops plus the TreeAttention function, so TensorRT and any ONNX runtime can run it, but ORT
executes it as ~110 kernels per layer (RMSNorm chains, RoPE arithmetic, the function body's shape
ops, a Slice+Concat of the cache window). For a 135M model at 4 bits a decode step is a few ms of
matmul and several ms of per-kernel overhead. This graph expresses one layer in
~10 kernels, the way onnxruntime-genai's builder does:

    SkipSimplifiedLayerNormalization (residual add + RMSNorm)
    MatMul q|k|v               (one matmul on the concatenated weights; quantized to MatMulNBits
                                like any other MatMul by --weights)
    GroupQueryAttention        (takes q|k|v packed, no Split; RoPE at `position_ids`, tree mask as
                                `attention_bias`, K/V written in place into the runtime's cache buffer)
    MatMul o, SkipSimplifiedLayerNormalization, MatMul gate|up + Split, Sigmoid-Mul-Mul, MatMul down

Contract (graph `target_ort`; dims batch, seq, total, rows, capacity):

    input_ids [batch, seq] i64, position_ids [batch, attn_seq] i64,
    attention_bias [batch, 1, attn_seq, total] float: 0 where new token t may see slot s, -inf where not
        (total = committed length + attn_seq: the window ends with the new tokens' own slots),
    seqlens_k [batch] i32 = total - 1, total_sequence_length [] i32 = total,
    logit_rows [batch, rows] i64, past_key_i / past_value_i [batch, kv_heads, capacity, head_dim]
    -> logits [batch, rows, vocab] f32, taps [batch, seq, n_taps*hidden] (with a drafter),
       present_key_i / present_value_i: the same buffers as past_key_i / past_value_i (bind them to
       the same memory; GroupQueryAttention then writes the new rows at slots total-seq .. total-1).

Attention rows (attn_seq >= seq; attn_seq = seq is the plain case). GroupQueryAttention runs over
attn_seq rows: the new tokens' packed q|k|v, then copies of the last one (a Gather before it, a Slice
of its first seq rows after it; everything else runs over seq rows). Why: GQA's CPU kernel multiplies
each head's attention probabilities by V in one MLAS SGEMM of M = seq query rows and alpha 1, and
MLAS sends such a product with M = 1 to a kernel of its own (x86-64: its one-row SGEMM kernel; ARM64:
its GEMV kernel), which rounds unlike the multi-row kernel: a plain ONNX MatMul [1, 300] x [300, 64]
here differs from the same row of [2, 300] x [300, 64] by up to 9e-8, while the two rows of the latter
agree bitwise. int8 activations amplify that into other text, so plain decoding on such engines could
not reproduce a verify step, and nothing a graph feeds GQA keeps a one-row call off that kernel:
exact one-row steps would need an attention kernel whose rows do not depend on their count. A one-token
call with attn_seq = 2 (the copy sees only itself and writes its K/V into the spare slot after the
token's, which the next call overwrites) takes the multi-row path in attention alone: the linear
layers, whose rows are independent (MatMulNBits at accuracy level 4 and the w8a8 integer MatMuls
give bitwise equal rows for one row or several), keep their one-row cost. Measured on the int4
SmolLM2 engine, 10 MT-bench prompts x 128 tokens: one-row decoding 131 tok/s (text equal to the
speculative decoder's on 2/10), attention rows 127 tok/s (10/10), two full rows 110 tok/s (10/10).
What the second row costs is GroupQueryAttention's second row and the Gather and Slice per layer,
not the bias and position inputs: a causal graph with the same attention rows and no bias or
positions gives these logits bitwise, and measured no faster end to end (paired 0.99x, 12 prompts x
256 tokens x 2, interleaved), so there is no such graph.

The causal twin (graph `target_ort_causal`, `build_graph(causal=True)`): the same layers without
position_ids, attention_bias or attention rows. GroupQueryAttention then masks causally and takes each
new token's position from its slot (total - seq + t), so it serves exactly the calls where both hold:
a prompt, a plain decoding step, a chain of new tokens right after the committed ones. For those its
logits, taps and K/V equal `target_ort`'s bitwise (its attention sums the same visible slots; a zero
bias adds nothing), and it skips what they cost: the bias and position inputs and the 2 x layers
attention-row kernels are ~10% of a one-token int4 call (interleaved raw ORT calls at 300 tokens of
context: `target_ort` 1.06-1.14x, this graph 0.96-1.02x the time of onnxruntime-genai's own int4
graph). The runtime loads it in place of `target_ort` for plain decoding in one-row calls
(`load_engines`).
Contract: `target_ort`'s without position_ids and attention_bias.

Limits, from GroupQueryAttention's CPU kernel: batch must be 1 whenever seq > 1 with a past, and
new tokens always occupy the slots right after the committed ones (true of the target engine:
`TorchTargetEngine` writes at length + t). The runtime therefore uses this graph for single-stream
requests and the portable graph for batches (`specrt.runtime.backends.ort_models`). GQA masks
causally on top of the bias, which a tree in topological order (parents first) already satisfies.
Not covered: targets with q/k norms (Qwen3) or a head size that is not a multiple of 16 (a
GroupQueryAttention requirement): the exporter skips this graph for them.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from specrt.plugins.errors import SpecrtError
from specrt.export.models.llama import LlamaModel
from specrt.export.onnx_export import _ONNX_DTYPE_NAMES, EXTERNAL_DATA_THRESHOLD, ExportedGraph, save_onnx
from specrt.export.shared_weights import PARTS_KEY

GRAPH_NAME = "target_ort"
CAUSAL_GRAPH_NAME = "target_ort_causal"  # the causal twin (module docstring)
# the symbolic dim of position_ids / attention_bias: attention's rows (module docstring); folders
# exported before it was added name it "seq" and cannot take a one-token call with attention rows
ATTENTION_ROWS_DIM = "attn_seq"
MS_DOMAIN = "com.microsoft"
_ELEM = {torch.float32: 1, torch.float16: 10}


# the Reshapes around the LM head's 2-D Gemm: once the quantizer turns the head into a MatMul (which
# takes [batch, rows, hidden] as is) they are pure cost (~90 us an int4 decode step: the last one copies
# the logits into the bound output), so `fold_head_reshapes` removes the nodes carrying these marks
HEAD_FLATTEN, HEAD_UNFLATTEN = "specrt.head_flatten", "specrt.head_unflatten"
MIN_ORT = (1, 22)  # GroupQueryAttention with position_ids and attention_bias on the CPU provider


def supports(model: LlamaModel) -> str | None:
    """None when the fused graph can express this target (with this onnxruntime), else the reason."""
    try:
        import onnxruntime as ort

        version = tuple(int(x) for x in ort.__version__.split(".")[:2])
    except Exception:  # no onnxruntime, or an unparsable dev version: let the export's own load check decide
        version = MIN_ORT
    if version < MIN_ORT:
        return (f"onnxruntime {ort.__version__} lacks GroupQueryAttention's position_ids/attention_bias inputs "
                f"(needs >= {MIN_ORT[0]}.{MIN_ORT[1]})")
    if model.config.qk_norm:
        return "q/k norms (Qwen3) have no place in GroupQueryAttention's CPU kernel"
    if model.config.head_dim % 16:
        return f"GroupQueryAttention needs a head size that is a multiple of 16, this target has {model.config.head_dim}"
    return None


class _Builder:
    """Accumulates nodes and initializers; names are derived from the module path they come from."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.nodes: list = []
        self.initializers: list = []
        # ranks/shapes of activations ONNX shape inference cannot derive past contrib ops; the GGUF
        # pass (specrt.export.gguf_quant) reads the rank of every quantized MatMul's input
        self.value_info: dict[str, list] = {}
        self.elem = _ELEM[dtype]
        self.np_dtype = np.float32 if dtype == torch.float32 else np.float16

    def weight(self, name: str, tensor: torch.Tensor, transpose: bool = False) -> str:
        from onnx import numpy_helper

        array = tensor.detach().to(torch.float32).cpu().numpy()
        if transpose:
            array = array.T
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array.astype(self.np_dtype)), name))
        return name

    def const(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], name: str, domain: str = "", **attrs) -> list[str]:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return [o for o in outputs if o]  # "" marks an optional output left out

    def mark(self, key: str) -> None:
        """Tag the last node for a later pass (`specrt.export.quantize.fold_head_reshapes`)."""
        entry = self.nodes[-1].metadata_props.add()
        entry.key, entry.value = key, "1"

    def linear(self, x: str, module: torch.nn.Linear, name: str) -> str:
        """x @ W^T (+ b) as MatMul on a [in, out] weight: the form the weight-only quantizers take."""
        self.value_info.setdefault(x, ["batch", "seq", int(module.weight.shape[1])])
        w = self.weight(f"{name}.weight_t", module.weight, transpose=True)
        (y,) = self.node("MatMul", [x, w], [f"{name}.out"], name)
        if module.bias is not None:
            b = self.weight(f"{name}.bias", module.bias)
            (y,) = self.node("Add", [y, b], [f"{name}.biased"], f"{name}.bias_add")
        return y

    def fused_linear(self, x: str, modules: list[torch.nn.Linear], name: str) -> str:
        """Several projections of the same input as one MatMul on their weights concatenated along the
        output dim, for a consumer that takes them packed (GroupQueryAttention's q|k|v): one kernel (and
        one activation quantization) instead of several.
        The node records the part widths (`specrt.parts`) so the GGUF pass can find each part's blocks
        and specrt.export.shared_weights can store the packed weight as the portable graph's tensors;
        RTN quantization is per output column, so fusing changes no weight."""
        self.value_info.setdefault(x, ["batch", "seq", int(modules[0].weight.shape[1])])
        widths = [int(m.weight.shape[0]) for m in modules]
        w = self.weight(f"{name}.weight_t", torch.cat([m.weight for m in modules], dim=0), transpose=True)
        (y,) = self.node("MatMul", [x, w], [f"{name}.out"], name)
        entry = self.nodes[-1].metadata_props.add()
        entry.key, entry.value = PARTS_KEY, ",".join(map(str, widths))
        if any(m.bias is not None for m in modules):
            bias = torch.cat([m.bias if m.bias is not None else torch.zeros(wd) for m, wd in zip(modules, widths)])
            b = self.weight(f"{name}.bias", bias)
            (y,) = self.node("Add", [y, b], [f"{name}.biased"], f"{name}.bias_add")
        return y


def rotary_tables(model: LlamaModel, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [positions, head_dim/2], computed exactly as `RotaryEmbedding` does per call."""
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * model.rotary.inv_freq[None, :].float()
    return freqs.cos().numpy().astype(np.float32), freqs.sin().numpy().astype(np.float32)


def _attention_rows(g: _Builder) -> tuple[str, str]:
    """(row index [attn_seq] = min(0..attn_seq-1, seq-1), seq as a 1-D tensor): the Gather that gives
    attention its attn_seq rows and the Slice bound that takes the seq real ones back (docstring)."""
    g.const("attention_rows.zero", np.array([0], dtype=np.int64))
    g.const("attention_rows.one", np.array([1], dtype=np.int64))
    g.const("attention_rows.zero_scalar", np.array(0, dtype=np.int64))
    g.const("attention_rows.one_scalar", np.array(1, dtype=np.int64))
    (ids_shape,) = g.node("Shape", ["input_ids"], ["attention_rows.ids_shape"], "attention_rows.ids_shape")
    (seq,) = g.node("Gather", [ids_shape, "attention_rows.one"], ["attention_rows.seq"], "attention_rows.seq", axis=0)
    (pos_shape,) = g.node("Shape", ["position_ids"], ["attention_rows.pos_shape"], "attention_rows.pos_shape")
    (rows,) = g.node("Gather", [pos_shape, "attention_rows.one_scalar"], ["attention_rows.count"],
                     "attention_rows.count", axis=0)
    (every,) = g.node("Range", ["attention_rows.zero_scalar", rows, "attention_rows.one_scalar"],
                      ["attention_rows.range"], "attention_rows.range")
    (last,) = g.node("Sub", [seq, "attention_rows.one"], ["attention_rows.last"], "attention_rows.last")
    (index,) = g.node("Min", [every, last], ["attention_rows.index"], "attention_rows.index")
    return index, seq


def build_graph(model: LlamaModel, dtype: torch.dtype = torch.float32, causal: bool = False):
    """The onnx.ModelProto of the fused target (weights in memory; `export_fused_target` saves it);
    causal: its causal twin, without position_ids, attention_bias and attention rows (docstring)."""
    from onnx import TensorProto, helper

    reason = supports(model)
    if reason:
        raise SpecrtError(f"the ORT-fused target graph cannot express this model: {reason}",
                          "export without it (specrt export --no-ort-fused); the portable graph runs everywhere")
    if dtype not in _ELEM:
        raise SpecrtError(f"unsupported dtype {dtype} for the ORT-fused graph", "use fp32 or fp16")
    c = model.config
    g = _Builder(dtype)
    elem = g.elem
    eps = float(c.rms_norm_eps)

    cos, sin = rotary_tables(model, c.max_position_embeddings)
    g.const("rotary.cos_cache", cos.astype(g.np_dtype))
    g.const("rotary.sin_cache", sin.astype(g.np_dtype))
    embed = g.weight("embed_tokens.weight", model.embed_tokens.weight)
    (x,) = g.node("Gather", [embed, "input_ids"], ["embedded"], "embed")

    attn_index, seq_1d = (None, None) if causal else _attention_rows(g)
    taps: dict[int, str] = {0: x}
    residual = x
    pending = None  # the previous layer's MLP output, not yet added to the residual
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        gamma = g.weight(f"{p}.input_layernorm.weight", layer.input_layernorm.weight)
        if pending is None:
            (h,) = g.node("SimplifiedLayerNormalization", [residual, gamma], [f"{p}.attn_in"], f"{p}.input_norm",
                          axis=-1, epsilon=eps)
        else:
            h, residual = g.node("SkipSimplifiedLayerNormalization", [pending, residual, gamma],
                                 [f"{p}.attn_in", "", "", f"{p}.residual_in"], f"{p}.input_norm",
                                 domain=MS_DOMAIN, epsilon=eps)
            taps[i] = residual
        attn = layer.self_attn
        # packed q|k|v (key and value left empty): GQA splits it itself, which saves a Split kernel
        # a layer (~5 us each at one row, 2% of an int4 decode step)
        qkv = g.fused_linear(h, [attn.q_proj, attn.k_proj, attn.v_proj], f"{p}.qkv_proj")
        attention_inputs = [qkv, "", "", f"past_key_{i}", f"past_value_{i}", "seqlens_k", "total_sequence_length",
                            "rotary.cos_cache", "rotary.sin_cache"]
        if not causal:
            (qkv_rows,) = g.node("Gather", [qkv, attn_index], [f"{p}.qkv_rows"], f"{p}.attention_rows", axis=1)
            attention_inputs[0] = qkv_rows
            attention_inputs += ["position_ids", "attention_bias"]
        (a_rows, _, _) = g.node(
            "GroupQueryAttention", attention_inputs,
            [f"{p}.attn_rows", f"present_key_{i}", f"present_value_{i}"], f"{p}.attention", domain=MS_DOMAIN,
            num_heads=c.num_heads, kv_num_heads=c.num_kv_heads, scale=1.0 / math.sqrt(c.head_dim),
            do_rotary=1, rotary_interleaved=0,
        )
        a = a_rows
        if not causal:
            (a,) = g.node("Slice", [a_rows, "attention_rows.zero", seq_1d, "attention_rows.one"], [f"{p}.attn"],
                          f"{p}.attention_rows_out")
        o = g.linear(a, attn.o_proj, f"{p}.o_proj")
        gamma = g.weight(f"{p}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        h, residual = g.node("SkipSimplifiedLayerNormalization", [o, residual, gamma],
                             [f"{p}.mlp_in", "", "", f"{p}.residual_mid"], f"{p}.post_norm",
                             domain=MS_DOMAIN, epsilon=eps)
        mlp = layer.mlp
        # gate|up as one MatMul and a Split: each output column is computed alike either way (bitwise,
        # checked on int4 and fp32 graphs); on int4 the one activation quantization and kernel instead of
        # two make a one-token call 3-6% and a four-token verify 1-2% faster (interleaved raw ORT calls,
        # onnxruntime 1.32), on fp32 it is even
        gate_up = g.fused_linear(h, [mlp.gate_proj, mlp.up_proj], f"{p}.gate_up_proj")
        gate, up = g.node("Split", [gate_up], [f"{p}.gate_proj.out", f"{p}.up_proj.out"], f"{p}.gate_up_split",
                          axis=-1, num_outputs=2)
        (sig,) = g.node("Sigmoid", [gate], [f"{p}.gate_sigmoid"], f"{p}.sigmoid")
        (silu,) = g.node("Mul", [gate, sig], [f"{p}.gate_silu"], f"{p}.silu")
        (act,) = g.node("Mul", [silu, up], [f"{p}.act"], f"{p}.act_mul")
        pending = g.linear(act, mlp.down_proj, f"{p}.down_proj")

    gamma = g.weight("norm.weight", model.norm.weight)
    normed, residual = g.node("SkipSimplifiedLayerNormalization", [pending, residual, gamma],
                              ["final_normed", "", "", "final_residual"], "final_norm", domain=MS_DOMAIN, epsilon=eps)
    taps[c.num_layers] = residual
    # logits only for logit_rows: GatherND with batch_dims=1 on [batch, seq, hidden]
    g.const("axes_last", np.array([-1], dtype=np.int64))
    (rows_index,) = g.node("Unsqueeze", ["logit_rows", "axes_last"], ["logit_rows_index"], "rows_index")
    (rows,) = g.node("GatherND", [normed, rows_index], ["row_states"], "gather_rows", batch_dims=1)
    if c.tie_word_embeddings:
        head_weight = embed
    else:
        head_weight = g.weight("lm_head.weight", model.lm_head.weight)
    # Gemm(transB=1) on the [vocab, hidden] weight as stored: a tied head is not stored twice, and the
    # quantizers' head rewrite (specrt.export.quantize.gemm_heads_to_matmul) recognises it
    g.const("flat_shape", np.array([-1, c.hidden_size], dtype=np.int64))
    (flat,) = g.node("Reshape", [rows, "flat_shape"], ["row_states_2d"], "flatten_rows")
    g.mark(HEAD_FLATTEN)
    (head,) = g.node("Gemm", [flat, head_weight], ["logits_2d"], "lm_head", transB=1)
    (rows_shape,) = g.node("Shape", ["logit_rows"], ["rows_shape"], "rows_shape")
    g.const("vocab_dim", np.array([c.vocab_size], dtype=np.int64))
    (out_shape,) = g.node("Concat", [rows_shape, "vocab_dim"], ["logits_shape"], "logits_shape", axis=0)
    logits_name = "logits" if dtype == torch.float32 else "logits_native"
    g.node("Reshape", [head, out_shape], [logits_name], "unflatten_logits")
    g.mark(HEAD_UNFLATTEN)
    if dtype != torch.float32:
        g.node("Cast", [logits_name], ["logits"], "logits_float", to=TensorProto.FLOAT)

    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "rows", c.vocab_size])]
    if model.tap_layers:
        g.node("Concat", [taps[t] for t in model.tap_layers], ["taps"], "taps", axis=-1)
        outputs.append(helper.make_tensor_value_info("taps", elem, ["batch", "seq", len(model.tap_layers) * c.hidden_size]))
    cache_shape = ["batch", c.num_kv_heads, "capacity", c.head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("logit_rows", TensorProto.INT64, ["batch", "rows"]),
    ]
    if not causal:
        inputs[1:1] = [
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", ATTENTION_ROWS_DIM]),
            helper.make_tensor_value_info("attention_bias", elem, ["batch", 1, ATTENTION_ROWS_DIM, "total"]),
        ]
    for i in range(c.num_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", elem, cache_shape))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", elem, cache_shape))
    known = {v.name for v in inputs + outputs}
    value_info = [helper.make_tensor_value_info(name, elem, shape) for name, shape in g.value_info.items()
                  if name not in known]
    graph = helper.make_graph(g.nodes, CAUSAL_GRAPH_NAME if causal else GRAPH_NAME, inputs, outputs,
                              initializer=g.initializers,
                              value_info=value_info)
    model_proto = helper.make_model(graph, producer_name="specrt",
                                    opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(MS_DOMAIN, 1)])
    model_proto.ir_version = 10
    return model_proto


def _io(values) -> list[dict]:
    """Manifest entries of onnx ValueInfoProtos (onnx_export._io_description does this for onnx_ir)."""
    out = []
    for v in values:
        t = v.type.tensor_type
        out.append({"name": v.name, "dtype": _ONNX_DTYPE_NAMES.get(t.elem_type, str(t.elem_type)),
                    "shape": [d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim]})
    return out


def validate(path: Path) -> None:
    """Load it in an ORT session: ORT knows the contrib-op schemas (onnx's checker does not know
    SimplifiedLayerNormalization, which ORT registers in the default domain), types and shapes."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as err:
        raise RuntimeError(f"{path.name} does not load in ONNX Runtime: {str(err).splitlines()[0][:300]}") from err


def export_fused_target(model: LlamaModel, folder: Path, dtype: torch.dtype = torch.float32,
                        external_data: str = "auto", causal: bool = False) -> ExportedGraph:
    """Write folder/target_ort.onnx (causal: target_ort_causal.onnx) (+ .data) and return its manifest
    entry (`runtime`: onnxruntime)."""
    start = time.perf_counter()
    name = CAUSAL_GRAPH_NAME if causal else GRAPH_NAME
    proto = build_graph(model, dtype, causal)
    weight_bytes = sum(int(np.prod(t.dims)) * (4 if t.data_type == 1 else 2) for t in proto.graph.initializer)
    use_external = external_data == "always" or (external_data == "auto" and weight_bytes > EXTERNAL_DATA_THRESHOLD)
    path = Path(folder) / f"{name}.onnx"
    inputs, outputs = _io(proto.graph.input), _io(proto.graph.output)
    data_path = save_onnx(proto, path, use_external)
    del proto
    validate(path)
    what = "causal calls only: prompts, plain steps, chains; " if causal else ""
    return ExportedGraph(name, f"target forward on ONNX Runtime contrib ops (single stream; {what}see "
                         "specrt.export.ort_fused)", path, data_path, time.perf_counter() - start, [],
                         inputs, outputs, runtime="onnxruntime")
