"""TensorRT plugins for `specrt::TreeAttention` and `specrt::ConfidenceTruncate` via `tensorrt.plugin`.

    from specrt.plugins.trt_plugins import register_plugins
    register_plugins()      # once per process, before parsing an ONNX graph or loading a JIT-plugin engine

Each op gets the four `tensorrt.plugin` definitions:
  * `@trtp.register("specrt::<Op>")` - the shape/type descriptor. The plugin id is the ONNX node's
    domain and op type, so TensorRT's ONNX parser imports a `specrt` node as this plugin instead of
    inlining its model-local function once the node carries `plugin_namespace="specrt"` (what
    `specrt build` adds; see specrt.export.build). Inputs, outputs and the `scale` attribute are
    the ONNX contract's (specrt.plugins.tree_attention / confidence_truncate).
  * `@trtp.autotune` - the I/O type combinations: float32 / float16 / bfloat16 activations with
    bool masks; ConfidenceTruncate's outputs are always float32 + int64.
  * `@trtp.aot_impl` - compiles the Triton kernel to PTX at build time and returns it with symbolic
    launch parameters and int32 arguments, so the kernel is embedded in the plan and a C++ app
    needs only the TensorRT runtime (no Python, no Triton). The node carries `aot=1` to pick it.
  * `@trtp.impl` - the just-in-time fallback: TensorRT calls back into Python at run time and the
    Triton kernel runs through its usual launcher (engines built with --plugin-mode jit).

Attribute handling: AOT plugins do not serialize attributes into the engine, so `scale` is baked
into the compiled kernel as a constexpr (one PTX per distinct scale, which is one per model).

The definitions are written against the `PluginAPI` protocol (specrt.plugins.trt_api), so the same
code registers with the real `tensorrt.plugin` or, in the unit tests, with a small fake that checks
the schemas; `tensorrt.plugin` validates annotations at registration, so they are set from the API
object's own classes rather than from this module's (string) annotations.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from specrt.plugins.errors import SpecrtError
from specrt.plugins import confidence_truncate as ct_op
from specrt.plugins import tree_attention as ta_op
from specrt.plugins.trt_api import PluginAPI, SymExpr, TensorDescLike, load_plugin_api

TD = TensorDescLike  # short name for the signatures below

NAMESPACE = "specrt"
PLUGIN_OPS = (ta_op.OP_NAME, ct_op.OP_NAME)
FLOAT_TYPES = "FP32|FP16|BF16"
_TRITON_DTYPES = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16"}
_registered: dict[int, list[str]] = {}


def plugin_id(op: str) -> str:
    return f"{NAMESPACE}::{op}"


def triton_dtype(dtype: Any) -> str:
    """tensorrt.DataType (FLOAT / HALF / BF16) -> Triton's pointer element name."""
    name = getattr(dtype, "name", str(dtype)).split(".")[-1].upper()
    if name not in _TRITON_DTYPES:
        raise SpecrtError(f"the specrt plugins do not support TensorRT data type {name}",
                          "use fp32, fp16 or bf16 graphs")
    return _TRITON_DTYPES[name]


def _constant(expr: SymExpr | int, what: str) -> int:
    if isinstance(expr, int):
        return expr
    if getattr(expr, "is_fake", False) or not expr.is_constant:
        raise SpecrtError(f"TreeAttention needs a static {what} to compile its kernel",
                          "export the graph with a fixed head dimension (specrt export does)")
    return int(expr.constant_value())


class Dims(Protocol):
    """A shape: trtp.ShapeExprs (symbolic) or a tuple of ints."""

    def __getitem__(self, index: int, /) -> Any: ...


def attention_scalars(q: Dims, k: Dims, pk: Dims, pm: Dims) -> list[Any]:
    """The kernel's int32 arguments (ATTENTION_SCALARS order) for contiguous tensors of these shapes.

    Works on symbolic shape expressions (the AOT plugin) and on plain ints (the tests compare it with
    the strides the torch wrapper passes).
    """
    b, hq, t, d = q[0], q[1], q[2], q[3]
    hkv, c, s = k[1], pk[2], pm[2]
    del b
    q_strides = [hq * t * d, t * d, d]
    kv_strides = [hkv * t * d, t * d, d]
    cache_strides = [hkv * c * d, c * d, d]
    return [hkv, hq // hkv, t, s, d, *q_strides, *kv_strides, *kv_strides, *cache_strides, *cache_strides,
            t * s, s, t * t, t, *q_strides]


def confidence_scalars(conf: Dims, sps: Dims) -> list[Any]:
    """(batch, steps, table_len, conf row stride) for a contiguous conf_logits [B, K] and sps [M]."""
    return [conf[0], conf[1], sps[0], conf[1]]


def _tuple_of(*types: Any) -> Any:
    """tuple[types...] built at run time (the classes come from the API object, not from this module)."""
    return tuple.__class_getitem__(types)


def _annotate(fn: Callable[..., Any], annotations: dict[str, Any]) -> Callable[..., Any]:
    fn.__annotations__ = dict(annotations)
    return fn


def _torch_view(tensor: Any) -> Any:
    import torch

    return torch.as_tensor(tensor, device="cuda")


def define_tree_attention(trtp: PluginAPI) -> None:
    from specrt.plugins import triton_tree_attention as kernels
    from specrt.plugins.triton_aot import compile_kernel

    pid = plugin_id(ta_op.OP_NAME)
    names = ta_op.INPUTS
    tensor_ann = {name: trtp.TensorDesc for name in names}

    def descriptor(query: TD, key: TD, value: TD, past_key: TD,
                   past_value: TD, past_mask: TD, tree_mask: TD, scale: float) -> TD:
        return query.like()  # output [B, Hq, T, D] in the query's type

    def autotune(query: TD, key: TD, value: TD, past_key: TD,
                 past_value: TD, past_mask: TD, tree_mask: TD, outputs: tuple) -> list:
        floats = FLOAT_TYPES
        return [trtp.AutoTuneCombination(f"{floats}, {floats}, {floats}, {floats}, {floats}, BOOL, BOOL, {floats}")]

    def aot(query: TD, key: TD, value: TD, past_key: TD, past_value: TD,
            past_mask: TD, tree_mask: TD, scale: float, outputs: tuple, tactic: int) -> tuple:
        dtype = triton_dtype(query.dtype)
        head_dim = _constant(query.shape_expr[3], "head dimension")
        kernel = compile_kernel(kernels.tree_attention_kernel, kernels.attention_signature(dtype),
                                kernels.attention_constexprs(scale, head_dim, dtype))
        q, k = query.shape_expr, key.shape_expr
        params = trtp.KernelLaunchParams()
        params.grid_x = q[0] * k[1]
        params.grid_y = trtp.cdiv((q[1] // k[1]) * q[2], kernels.BLOCK_M)
        params.block_x = kernel.block_x
        params.shared_mem = kernel.shared
        scalars = attention_scalars(q, k, past_key.shape_expr, past_mask.shape_expr)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in scalars])
        return kernel.name.encode(), kernel.ptx.encode(), params, extra

    def impl(query: Any, key: Any, value: Any, past_key: Any, past_value: Any, past_mask: Any, tree_mask: Any,
             scale: float, outputs: tuple, stream: int) -> None:
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            q, k, v, pk, pv, pm, tm = (_torch_view(x) for x in (query, key, value, past_key, past_value, past_mask,
                                                                 tree_mask))
            kernels.tree_attention(q, k, v, pk, pv, pm, tm, scale=scale, out=_torch_view(outputs[0]))

    trtp.register(pid)(_annotate(descriptor, {**tensor_ann, "scale": float, "return": trtp.TensorDesc}))
    # no return annotation on autotune: tensorrt.plugin accepts only List[AutoTuneCombination] there
    trtp.autotune(pid)(_annotate(autotune, {**tensor_ann, "outputs": _tuple_of(trtp.TensorDesc)}))
    trtp.aot_impl(pid)(_annotate(aot, {
        **tensor_ann, "scale": float, "outputs": _tuple_of(trtp.TensorDesc), "tactic": int,
        "return": _tuple_of(bytes, bytes, trtp.KernelLaunchParams, trtp.SymIntExprs),
    }))
    trtp.impl(pid)(_annotate(impl, {**{n: trtp.Tensor for n in names}, "scale": float,
                                    "outputs": _tuple_of(trtp.Tensor), "stream": int, "return": None}))


def define_confidence_truncate(trtp: PluginAPI, float32: Any, int64: Any) -> None:
    """float32 / int64: the tensorrt.DataType values of the two outputs (trt.float32, trt.int64)."""
    from specrt.plugins import triton_confidence_truncate as kernels
    from specrt.plugins.triton_aot import compile_kernel

    pid = plugin_id(ct_op.OP_NAME)
    names = ct_op.INPUTS
    tensor_ann = {name: trtp.TensorDesc for name in names}

    def descriptor(conf_logits: TD, temperatures: TD, threshold: TD,
                   sps: TD) -> tuple:
        survival = conf_logits.like()
        survival.dtype = float32
        length = trtp.from_shape_expr((conf_logits.shape_expr[0],), dtype=int64)
        return survival, length

    def autotune(conf_logits: TD, temperatures: TD, threshold: TD, sps: TD,
                 outputs: tuple) -> list:
        floats = FLOAT_TYPES
        return [trtp.AutoTuneCombination(f"{floats}, {floats}, {floats}, {floats}, FP32, INT64")]

    def aot(conf_logits: TD, temperatures: TD, threshold: TD, sps: TD,
            outputs: tuple, tactic: int) -> tuple:
        kernel = compile_kernel(kernels.confidence_truncate_kernel, kernels.signature(triton_dtype(conf_logits.dtype)),
                                kernels.constexprs(), num_warps=8)
        params = trtp.KernelLaunchParams()
        params.block_x = kernel.block_x
        params.shared_mem = kernel.shared
        scalars = confidence_scalars(conf_logits.shape_expr, sps.shape_expr)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in scalars])
        return kernel.name.encode(), kernel.ptx.encode(), params, extra

    def impl(conf_logits: Any, temperatures: Any, threshold: Any, sps: Any, outputs: tuple, stream: int) -> None:
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            survival, length = kernels.confidence_truncate(*(_torch_view(x) for x in (conf_logits, temperatures,
                                                                                      threshold, sps)))
            _torch_view(outputs[0]).copy_(survival)
            _torch_view(outputs[1]).copy_(length)

    trtp.register(pid)(_annotate(descriptor, {**tensor_ann, "return": _tuple_of(trtp.TensorDesc, trtp.TensorDesc)}))
    trtp.autotune(pid)(_annotate(autotune, {**tensor_ann, "outputs": _tuple_of(trtp.TensorDesc, trtp.TensorDesc)}))
    trtp.aot_impl(pid)(_annotate(aot, {
        **tensor_ann, "outputs": _tuple_of(trtp.TensorDesc, trtp.TensorDesc), "tactic": int,
        "return": _tuple_of(bytes, bytes, trtp.KernelLaunchParams, trtp.SymIntExprs),
    }))
    trtp.impl(pid)(_annotate(impl, {**{n: trtp.Tensor for n in names},
                                    "outputs": _tuple_of(trtp.Tensor, trtp.Tensor), "stream": int, "return": None}))


def register_plugins(trtp: PluginAPI | None = None, float32: Any = None, int64: Any = None) -> list[str]:
    """Register both plugins (once per API object); returns their ids. Needs triton at build time only."""
    if trtp is None:
        trtp = load_plugin_api()
        import tensorrt as trt

        float32, int64 = trt.float32, trt.int64
    key = id(trtp)
    if key not in _registered:
        define_tree_attention(trtp)
        define_confidence_truncate(trtp, float32, int64)
        _registered[key] = [plugin_id(op) for op in PLUGIN_OPS]
    return list(_registered[key])


__all__ = ["register_plugins", "define_tree_attention", "define_confidence_truncate", "attention_scalars",
           "confidence_scalars", "plugin_id", "triton_dtype", "NAMESPACE", "PLUGIN_OPS"]
