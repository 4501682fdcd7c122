"""`specrt::TreeAttention`: attention of new tokens over a fixed-capacity K/V cache and themselves.

One op serves prefill (causal mask), decode (T = 1) and tree verification / tree drafting (an
ancestor-or-self mask), with grouped-query attention. It exists in three forms held to one
contract: the torch reference (`tree_attention_reference`, also the eager body of the torch
custom op `torch.ops.specrt.tree_attention` the export wrappers call), the ONNX model-local
function (`onnx_function`, standard ops only, emitted into every exported graph that attends), and
later a Triton kernel / TensorRT plugin of the same name.

Contract (ONNX domain `specrt`, op `TreeAttention`, version 1)
----------------------------------------------------------------
Inputs
    query       [B, Hq, T, D]   T(float)  new tokens' queries, RoPE applied
    key         [B, Hkv, T, D]  T         new tokens' keys, RoPE applied
    value       [B, Hkv, T, D]  T         new tokens' values
    past_key    [B, Hkv, C, D]  T         this layer's cache, C = its capacity (any C >= S)
    past_value  [B, Hkv, C, D]  T
    past_mask   [B, T, S]       bool      True: new token t sees cache slot s (S <= C is the window
                                          read, S may be 0)
    tree_mask   [B, T, T]       bool      True: new token t sees new token u (causal, tree
                                          ancestor-or-self, all-true for a DFlash/DSpark block)
Attributes
    scale       float (required)          score scale, normally 1/sqrt(D)
Output
    output      [B, Hq, T, D]   T         softmax(scale * q . [K_past[:S]; K_new]) . [V_past[:S]; V_new]
T(float) is float32, float16 or bfloat16; the body computes in float32 and casts back. Hq must be
a multiple of Hkv; query head h uses K/V head h // (Hq / Hkv) (the usual GQA grouping).
A query row whose masks are all False gets an all-zero output (no NaN).

Cache update: who writes the new K/V
------------------------------------
The op does not write the cache; the graph that contains it returns the new tokens' K/V (its
`new_keys` / `new_values` outputs, [L, B, Hkv, T, D]) and the runtime copies the rows it keeps into
its own buffer. Why not a cache input/output updated with ScatterND inside the graph: ONNX has no
in-place semantics, so a ScatterND on a [B, Hkv, C, D] graph input produces a fresh C-sized output
per layer per step - every step would copy the whole cache, the cost DESIGN.md rules out. Here the
per-step cost is reading the S-slot window the attention needs anyway plus writing T rows. It also
fits speculative decoding better: after tree verification the runtime writes only the accepted
path's rows, straight into contiguous slots, so there is no separate "gather the accepted path"
pass, and rejected drafts never touch the cache. The cache inputs are the runtime's own buffers
(one contiguous [B, Hkv, C, D] array per layer, bound without copies); a TensorRT plugin of this op
reads the window in place and never aliases its inputs.

The ONNX function body slices the window past_*[:, :, :S], concatenates the new K/V and mask,
folds the query heads per K/V head ([B, Hkv, G*T, D], so K/V are never repeated), masks with the
lowest finite float (not -inf, so fully masked rows stay finite) and zeroes masked probabilities.
"""

from __future__ import annotations

import math

import torch

OP_NAME = "TreeAttention"
TORCH_OP = "specrt::tree_attention"
INPUTS = ("query", "key", "value", "past_key", "past_value", "past_mask", "tree_mask")
OUTPUTS = ("output",)


def tree_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    past_mask: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The contract above in plain torch (float32 math, output in query's dtype)."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    window = past_mask.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    k = torch.cat([past_key[:, :, :window], key], dim=2).float()
    v = torch.cat([past_value[:, :, :window], value], dim=2).float()
    mask = torch.cat([past_mask, tree_mask], dim=-1).bool()  # [B, T, S+T]
    q = query.float().reshape(b, hkv, group * t, d)
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, Hkv, G*T, S+T]
    scores = scores.reshape(b, hkv, group, t, -1)
    visible = mask[:, None, None]
    lowest = torch.finfo(torch.float32).min
    probs = torch.softmax(scores.masked_fill(~visible, lowest), dim=-1) * visible
    out = probs.reshape(b, hkv, group * t, -1) @ v
    return out.reshape(b, hq, t, d).to(query.dtype)


@torch.library.custom_op(TORCH_OP, mutates_args=())
def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    past_mask: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch custom op (eager body = the reference); the ONNX exporter maps it to specrt::TreeAttention."""
    return tree_attention_reference(query, key, value, past_key, past_value, past_mask, tree_mask, scale)


@tree_attention.register_fake
def _tree_attention_fake(query, key, value, past_key, past_value, past_mask, tree_mask, scale):
    return query.new_empty(query.shape)


# -- ONNX ------------------------------------------------------------------------------------------
def onnx_schema():
    """The onnx.defs.OpSchema of the op (registered only while exporting, see specrt.plugins.onnx_ops)."""
    from onnx.defs import OpSchema

    p = OpSchema.FormalParameter
    return OpSchema(
        OP_NAME,
        "specrt",
        1,
        doc=__doc__.split("\n\n")[0],
        inputs=[p(name, "B" if name.endswith("mask") else "T") for name in INPUTS],
        outputs=[p("output", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types"),
            ("B", ["tensor(bool)"], "masks"),
        ],
        attributes=[OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "score scale, 1/sqrt(D)", required=True)],
    )


def onnx_function(opset_version: int):
    """The model-local function body (an onnxscript OnnxFunction) for a model of `opset_version`."""
    import onnxscript
    from onnxscript.values import Opset

    op = getattr(onnxscript, f"opset{opset_version}")
    specrt = Opset("specrt", 1)

    @onnxscript.script(specrt, default_opset=op)
    def TreeAttention(query, key, value, past_key, past_value, past_mask, tree_mask, scale: float):
        zero = op.Constant(value_ints=[0])
        one = op.Constant(value_ints=[1])
        two = op.Constant(value_ints=[2])
        three = op.Constant(value_ints=[3])
        window = op.Shape(past_mask, start=2, end=3)  # [S]
        k_past = op.Slice(past_key, zero, window, two)
        v_past = op.Slice(past_value, zero, window, two)
        k = op.Cast(op.Concat(k_past, key, axis=2), to=1)  # [B, Hkv, S+T, D] float32
        v = op.Cast(op.Concat(v_past, value, axis=2), to=1)
        mask = op.Concat(past_mask, tree_mask, axis=2)  # [B, T, S+T]
        q_shape = op.Shape(query)  # [B, Hq, T, D]
        batch = op.Gather(q_shape, zero)
        heads = op.Gather(q_shape, one)
        steps = op.Gather(q_shape, two)
        dim = op.Gather(q_shape, three)
        kv_heads = op.Shape(key, start=1, end=2)
        group = op.Div(heads, kv_heads)
        minus_one = op.Constant(value_ints=[-1])
        q = op.Reshape(op.Cast(query, to=1), op.Concat(batch, kv_heads, minus_one, dim, axis=0))  # [B,Hkv,G*T,D]
        scale_f = op.Constant(value_float=scale)
        scores = op.Mul(op.MatMul(q, op.Transpose(k, perm=[0, 1, 3, 2])), scale_f)  # [B,Hkv,G*T,S+T]
        scores5 = op.Reshape(scores, op.Concat(batch, kv_heads, group, steps, minus_one, axis=0))
        visible = op.Unsqueeze(mask, op.Constant(value_ints=[1, 2]))  # [B,1,1,T,S+T]
        lowest = op.Constant(value_float=-3.4028234663852886e38)
        probs = op.Softmax(op.Where(visible, scores5, lowest), axis=-1)
        probs = op.Mul(probs, op.Cast(visible, to=1))
        probs4 = op.Reshape(probs, op.Concat(batch, kv_heads, minus_one, op.Shape(mask, start=2, end=3), axis=0))
        out = op.Reshape(op.MatMul(probs4, v), q_shape)  # [B, Hq, T, D]
        output = op.CastLike(out, query)
        return output

    return TreeAttention


def translation(query, key, value, past_key, past_value, past_mask, tree_mask, scale: float):
    """custom_translation_table entry: one specrt::TreeAttention node (body attached after export)."""
    from onnxscript.values import Opset

    return Opset("specrt", 1).TreeAttention(
        query, key, value, past_key, past_value, past_mask, tree_mask, scale=float(scale)
    )


__all__ = [
    "tree_attention", "tree_attention_reference", "onnx_function", "onnx_schema", "translation",
    "OP_NAME", "TORCH_OP", "INPUTS", "OUTPUTS",
]
