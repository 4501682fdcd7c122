"""ONNX graphs of the target and the drafters, with the specrt custom ops as model-local functions.

Every graph is a small export wrapper (an nn.Module reusing the torch model's own submodules and
weights) whose attention goes through `torch.ops.specrt.tree_attention`; `export_graph` runs
`torch.onnx.export(dynamo=True)`, maps the custom ops to `specrt::*` nodes, attaches their bodies
(`specrt.plugins.onnx_ops`), names every dimension, saves (external data for big graphs) and
validates (checker with full_check, strict shape inference, only standard ops + specrt functions).

K/V caches (all graphs): one input pair per attention layer, `past_key_{i}` / `past_value_{i}`
[batch, kv_heads, capacity, head_dim], the runtime's own fixed-capacity buffers, read-only. A graph
that produces K/V the runtime must keep returns them as `new_keys` / `new_values`
[layers, batch, kv_heads, seq, head_dim]; the runtime writes the rows it keeps into its buffers
(see specrt.plugins.tree_attention: why the graph never rewrites the cache). `past_mask`
[batch, seq, past] says which of the first `past` cache slots each new token sees (past may be 0),
`tree_mask` [batch, seq, seq] which new tokens it sees.

Graphs (dims: batch, seq, rows, past, capacity, block are dynamic; gamma is DSpark's block size):

target            input_ids [batch, seq] i64, position_ids [batch, seq] i64, past_mask, tree_mask,
                  logit_rows [batch, rows] i64, past_key_i/past_value_i (i < layers)
                  -> logits [batch, rows, vocab] f32, taps [batch, seq, n_taps*hidden] (only with a
                  drafter), new_keys, new_values [layers, batch, kv_heads, seq, head_dim]
                  One graph for prefill (causal tree_mask, empty past), decode and tree verification.
eagle3_fc         taps [batch, seq, 3*target_hidden] -> hidden [batch, seq, hidden]
eagle3_step       input_ids, hidden [batch, seq, hidden], position_ids, past_mask, tree_mask,
                  logit_rows [batch, rows] i64, past_key_0, past_value_0 -> logits [batch, rows,
                  draft_vocab] f32 (draft ids: map with draft_to_target.npy), hidden_out [batch, seq,
                  hidden], new_keys, new_values [1, batch, kv_heads, seq, head_dim]. Context rows
                  (fc(taps), next token) and tree expansion (a frontier of nodes, tree_mask
                  ancestor-or-self over earlier scratch slots through past_mask) are both this graph.
                  A context ingest asks for its last row's logits alone: the head over the draft
                  vocabulary is ~60% of a row (int4 SmolLM2 drafter, 2 threads: 87 rows 13.6 ms).
{dflash,dspark}_ingest  taps [batch, seq, n_taps*target_hidden], position_ids -> new_keys,
                  new_values [drafter_layers, batch, kv_heads, seq, head_dim] (context K/V)
dflash_block      block_ids [batch, block] i64 ([anchor, MASK...]), position_ids [batch, block],
                  past_mask [batch, block, past] (context slots < anchor position), past_key_i/
                  past_value_i -> logits [batch, block, vocab] f32, hidden [batch, block, hidden].
                  Non-causal inside the block (the all-true tree_mask is built in the graph); the
                  block's own K/V are scratch and never leave the graph.
dspark_block      block_ids [batch, gamma], position_ids, past_mask, past_key_i/past_value_i,
                  temperature [batch] f32, gumbel [batch, gamma, vocab] f32, threshold [] f32,
                  sps [sps_len] f32 -> tokens [batch, gamma] i64, markov_logits [batch, gamma, vocab]
                  f32, conf_logits [batch, gamma] f32, survival [batch, gamma] f32,
                  draft_length [batch] i64 (ConfidenceTruncate: threshold or SPS policy).
                  The Markov chain runs in the graph, unrolled over gamma (hence gamma is static):
                  x_k = argmax(l_k + temperature * gumbel_k). With temperature 0 that is greedy; with
                  T > 0 and standard Gumbel noise g = -log(-log(U)) drawn by the runtime it is an exact
                  sample of softmax(l_k / T) (Gumbel-max), so the graph stays deterministic and the
                  runtime owns the random stream. markov_logits are the l_k: the runtime forms the draft
                  distributions q_k = softmax(l_k / T) that lossless verification needs.

Reduced draft vocabulary (`specrt export --draft-vocab N`, DFlash/DSpark): the block head computes
logits over N target tokens only (`BlockHead`: their [N, H] rows of the LM head, stored as their own
weight), so `vocab` above is N for dflash_block's logits and dspark_block's gumbel and markov_logits;
DSpark's W2 keeps the same rows and its chain maps each drafted index to its target id inside the graph
(W1 and the confidence head read target ids), so dspark_block's tokens are target ids. The ids are the
folder's draft_to_target.npy. Why: the head over the full vocabulary was most of a drafting round on a
CPU (int4 SmolLM2, 2 threads: 10.5 of the DFlash block call's 13.3 ms; 6.2 of DSpark's 11.4 ms, with
~2.5 ms more of V-wide Markov and chain work).
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from specrt.plugins.errors import SpecrtError
from specrt.export.models.dflash import DFlashDrafter
from specrt.export.models.dspark import DSparkDrafter
from specrt.export.models.eagle3 import Eagle3Drafter
from specrt.export.models.layers import Attention, gather_rows
from specrt.export.models.llama import LlamaModel

DEFAULT_OPSET = 20
# graphs whose weights exceed this are saved with external data (protobuf's hard limit is 2 GiB)
EXTERNAL_DATA_THRESHOLD = 512 * 1024 * 1024
# example sizes for tracing: distinct and > 1 so torch.export neither specialises nor equates dims
EXAMPLE_DIMS = {"batch": 2, "seq": 5, "rows": 3, "past": 7, "capacity": 11, "sps_len": 6}

_DTYPES = {"float32": torch.float32, "float16": torch.float16}
_ONNX_DTYPE_NAMES = {1: "float32", 7: "int64", 9: "bool", 10: "float16", 16: "bfloat16", 6: "int32"}


def _tree_attention():
    import specrt.plugins.tree_attention  # noqa: F401  (registers torch.ops.specrt.tree_attention)

    return torch.ops.specrt.tree_attention


def _confidence_truncate():
    import specrt.plugins.confidence_truncate  # noqa: F401

    return torch.ops.specrt.confidence_truncate


def _project(attn: Attention, x, cos, sin):
    """q, k, v in the activations' dtype (RoPE's float32 cos/sin would promote fp16 q/k to float32)."""
    q = attn.project_q(x, cos, sin)
    k, v = attn.project_kv(x, cos, sin)
    return q.to(v.dtype), k.to(v.dtype), v


def attend(attn: Attention, x, cos, sin, past_key, past_value, past_mask, tree_mask):
    """Attention block through specrt::TreeAttention: (o_proj output, new K, new V)."""
    b, t, _ = x.shape
    q, k, v = _project(attn, x, cos, sin)
    out = _tree_attention()(
        q, k, v, past_key, past_value, past_mask, tree_mask, 1.0 / math.sqrt(attn.head_dim)
    )
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.num_heads * attn.head_dim)), k, v


def linear_2d(x, weight):
    """x @ weight.T through a 2-D matmul: exports as Gemm(transB=1) on the weight as stored, so a head
    tied to the embedding is neither transposed at run time nor stored a second time, transposed."""
    lead = x.shape[:-1]
    return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), weight).reshape(*lead, weight.shape[0])


# -- export wrappers ---------------------------------------------------------------------------------
class TargetGraph(nn.Module):
    """LlamaModel with explicit read-only caches; returns the new K/V instead of writing them."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, past_mask, tree_mask, logit_rows, *caches):
        m = self.model
        x = m.embed_tokens(input_ids)
        cos, sin = m.rotary(position_ids)
        collected = {0: x} if 0 in m.tap_layers else {}
        keys, values = [], []
        for i, layer in enumerate(m.layers):
            h, k, v = attend(layer.self_attn, layer.input_layernorm(x), cos, sin,
                             caches[2 * i], caches[2 * i + 1], past_mask, tree_mask)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            keys.append(k)
            values.append(v)
            if i + 1 in m.tap_layers:
                collected[i + 1] = x
        rows = gather_rows(x, logit_rows)
        logits = linear_2d(m.norm(rows), m.lm_head.weight).float()
        new_keys, new_values = torch.stack(keys), torch.stack(values)
        if not m.tap_layers:
            return logits, new_keys, new_values
        taps = torch.cat([collected[i] for i in m.tap_layers], dim=-1)
        return logits, taps, new_keys, new_values


class Eagle3FcGraph(nn.Module):
    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, taps):
        return self.drafter.fuse(taps)


class Eagle3StepGraph(nn.Module):
    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, hidden, position_ids, past_mask, tree_mask, logit_rows, past_key_0, past_value_0):
        d = self.drafter
        mid = d.midlayer
        emb = d.embed(input_ids).to(hidden.dtype)
        cos, sin = d.rotary(position_ids)
        normed = mid.hidden_norm(hidden)
        x = torch.cat([mid.input_layernorm(emb), normed], dim=-1)
        h, k, v = attend(mid.self_attn, x, cos, sin, past_key_0, past_value_0, past_mask, tree_mask)
        h1 = (normed if mid.norm_before_residual else hidden) + h  # the speculators variant's residual
        out = h1 + mid.mlp(mid.post_attention_layernorm(h1))
        rows = gather_rows(out, logit_rows)
        logits = linear_2d(d.norm(rows), d.lm_head.weight).float()
        return logits, out, k[None], v[None]


class BlockIngestGraph(nn.Module):
    """DFlash/DSpark context ingest: taps of committed tokens -> every layer's context K/V."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, taps, position_ids):
        d = self.drafter
        context = d.context_features(taps)
        cos, sin = d.rotary(position_ids)
        keys, values = [], []
        for layer in d.layers:
            k, v = layer.self_attn.project_kv(context, cos, sin)
            keys.append(k.to(v.dtype))
            values.append(v)
        return torch.stack(keys), torch.stack(values)


def _block_backbone(d: DFlashDrafter, block_ids, position_ids, past_mask, caches):
    x = d.embed(block_ids)
    cos, sin = d.rotary(position_ids)
    b, k = block_ids.shape
    inside = torch.ones(b, k, k, dtype=torch.bool, device=block_ids.device)  # non-causal block
    for i, layer in enumerate(d.layers):
        h, _, _ = attend(layer.self_attn, layer.input_layernorm(x), cos, sin,
                         caches[2 * i], caches[2 * i + 1], past_mask, inside)
        x = x + h
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return d.norm(x)


def _head_is_embedding(d: DFlashDrafter) -> bool:
    """True when the bound LM head is the embedding tensor (tied target): the graph stores it once."""
    head, embed = d.target_lm_head_weight, d.target_embed_weight
    return (embed is not None and head is not None and head.shape == embed.shape
            and head.data_ptr() == embed.data_ptr())


class BlockHead(nn.Module):
    """The target's LM head as a block graph computes it: over every target token, or over the rows
    of a reduced draft vocabulary (`token_ids` [N], target ids): the [N, H] rows are stored as their
    own weight, so the per-call cost is N / V of the full head's."""

    def __init__(self, drafter: DFlashDrafter, token_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.tied = _head_is_embedding(drafter)
        self.register_buffer("rows", None if token_ids is None else drafter.target_lm_head_weight[token_ids].clone())

    def forward(self, hidden):
        d = self.drafter
        head = self.rows if self.rows is not None else d.target_embed_weight if self.tied else d.target_lm_head_weight
        return linear_2d(hidden.to(head.dtype), head).float()


class DFlashBlockGraph(nn.Module):
    def __init__(self, drafter: DFlashDrafter, token_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.head = BlockHead(drafter, token_ids)

    def forward(self, block_ids, position_ids, past_mask, *caches):
        hidden = _block_backbone(self.drafter, block_ids, position_ids, past_mask, caches)
        return self.head(hidden), hidden


class DSparkBlockGraph(nn.Module):
    """With a reduced draft vocabulary (`token_ids`) the base logits, W2's rows, the Gumbel noise and
    markov_logits cover those N tokens; the drafted index is mapped to its target id in the graph,
    because W1 (the next step's Markov input and the confidence head's) is indexed by target ids.
    `tokens` are target ids either way."""

    def __init__(self, drafter: DSparkDrafter, token_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.num_layers = drafter.config.num_layers
        self.head = BlockHead(drafter, token_ids)
        reduced = token_ids is not None
        self.register_buffer("markov_rows", drafter.markov_w2.weight[token_ids].clone() if reduced else None)
        self.register_buffer("token_ids", token_ids.clone() if reduced else None)

    def forward(self, block_ids, position_ids, past_mask, *rest):
        d = self.drafter
        n = 2 * self.num_layers
        caches, (temperature, gumbel, threshold, sps) = rest[:n], rest[n:]
        hidden = _block_backbone(d, block_ids, position_ids, past_mask, caches)
        base = self.head(hidden)  # [B, gamma, V or N] float32
        prev = block_ids[:, 0]
        state = None
        tokens, logits, confs = [], [], []
        for k in range(block_ids.shape[1]):
            step_logits, state = d.markov_head.step(base[:, k], prev, hidden[:, k], state, self.markov_rows)
            confs.append(d.confidence(hidden[:, k], prev))
            # Gumbel-max: greedy at temperature 0, an exact softmax(l / T) sample otherwise
            token = torch.argmax(step_logits + temperature[:, None] * gumbel[:, k], dim=-1)
            if self.token_ids is not None:
                token = self.token_ids[token]  # draft index -> target id
            tokens.append(token)
            logits.append(step_logits)
            prev = token
        conf = torch.stack(confs, dim=1)
        survival, length = _confidence_truncate()(conf, d.sts_temperatures.float(), threshold, sps)
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1), conf, survival, length


# -- graph specifications -----------------------------------------------------------------------------
@dataclass
class GraphSpec:
    """One graph to export: the wrapper, its named inputs/outputs and their symbolic shapes."""

    name: str
    description: str
    module: nn.Module
    inputs: list[tuple[str, torch.dtype, list[Any]]]  # (name, dtype, shape: ints and dim names)
    outputs: list[tuple[str, list[Any]]]  # (name, shape); dtypes come from the graph
    example_sizes: dict[str, int] = field(default_factory=dict)  # overrides EXAMPLE_DIMS for tracing

    def example_args(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(0)
        dims = {**EXAMPLE_DIMS, **self.example_sizes}
        args = []
        for name, dtype, shape in self.inputs:
            size = [d if isinstance(d, int) else dims[d] for d in shape]
            if dtype == torch.bool:
                args.append(torch.ones(size, dtype=torch.bool))
            elif dtype == torch.long:
                args.append(torch.randint(0, 2, size, generator=g))
            else:
                args.append(torch.randn(size, generator=g).to(dtype))
        return tuple(args)

    def dynamic_shapes(self) -> tuple:
        """torch.export dynamic_shapes, shaped like forward's signature (a trailing *args is one tuple)."""
        import inspect

        flat = [{i: d for i, d in enumerate(shape) if isinstance(d, str)} or None for _, _, shape in self.inputs]
        params = list(inspect.signature(self.module.forward).parameters.values())
        fixed = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if any(p.kind == p.VAR_POSITIONAL for p in params):
            return tuple(flat[: len(fixed)]) + (tuple(flat[len(fixed):]),)
        return tuple(flat)


def _cache_inputs(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> list:
    out = []
    for i in range(layers):
        for kind in ("key", "value"):
            out.append((f"past_{kind}_{i}", dtype, ["batch", kv_heads, "capacity", head_dim]))
    return out


def target_spec(model: LlamaModel, dtype: torch.dtype) -> GraphSpec:
    c = model.config
    inputs = [
        ("input_ids", torch.long, ["batch", "seq"]),
        ("position_ids", torch.long, ["batch", "seq"]),
        ("past_mask", torch.bool, ["batch", "seq", "past"]),
        ("tree_mask", torch.bool, ["batch", "seq", "seq"]),
        ("logit_rows", torch.long, ["batch", "rows"]),
    ] + _cache_inputs(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
    outputs: list = [("logits", ["batch", "rows", c.vocab_size])]
    if model.tap_layers:
        outputs.append(("taps", ["batch", "seq", len(model.tap_layers) * c.hidden_size]))
    kv = [c.num_layers, "batch", c.num_kv_heads, "seq", c.head_dim]
    outputs += [("new_keys", kv), ("new_values", kv)]
    return GraphSpec("target", "target forward: prefill, decode and tree verification", TargetGraph(model),
                     inputs, outputs)


def drafter_specs(drafter, dtype: torch.dtype, draft_vocab: torch.Tensor | None = None) -> list[GraphSpec]:
    """The drafter's graphs; draft_vocab: a DFlash/DSpark block head over these target ids only
    (sorted, unique; see `BlockHead`), None for the full vocabulary."""
    c = drafter.config
    if isinstance(drafter, Eagle3Drafter):
        kv = [1, "batch", c.num_kv_heads, "seq", c.head_dim]
        return [
            GraphSpec("eagle3_fc", "EAGLE-3 fc: target taps -> drafter feature", Eagle3FcGraph(drafter),
                      [("taps", dtype, ["batch", "seq", 3 * c.target_hidden_size])],
                      [("hidden", ["batch", "seq", c.hidden_size])]),
            GraphSpec(
                "eagle3_step", "EAGLE-3 step: context rows and tree expansion", Eagle3StepGraph(drafter),
                [
                    ("input_ids", torch.long, ["batch", "seq"]),
                    ("hidden", dtype, ["batch", "seq", c.hidden_size]),
                    ("position_ids", torch.long, ["batch", "seq"]),
                    ("past_mask", torch.bool, ["batch", "seq", "past"]),
                    ("tree_mask", torch.bool, ["batch", "seq", "seq"]),
                    ("logit_rows", torch.long, ["batch", "rows"]),
                ] + _cache_inputs(1, c.num_kv_heads, c.head_dim, dtype),
                [("logits", ["batch", "rows", c.draft_vocab_size]), ("hidden_out", ["batch", "seq", c.hidden_size]),
                 ("new_keys", kv), ("new_values", kv)],
            ),
        ]
    if isinstance(drafter, Eagle3Drafter) or draft_vocab is None:
        vocab = c.vocab_size
    else:
        draft_vocab = check_draft_vocab(draft_vocab, c.vocab_size)
        vocab = int(draft_vocab.shape[0])
    kind = "dspark" if isinstance(drafter, DSparkDrafter) else "dflash"
    kv = [c.num_layers, "batch", c.num_kv_heads, "seq", c.head_dim]
    ingest = GraphSpec(
        f"{kind}_ingest", f"{kind} context ingest: target taps -> context K/V", BlockIngestGraph(drafter),
        [("taps", dtype, ["batch", "seq", len(c.tap_layers) * c.target_hidden_size]),
         ("position_ids", torch.long, ["batch", "seq"])],
        [("new_keys", kv), ("new_values", kv)],
    )
    caches = _cache_inputs(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
    if kind == "dflash":
        block = GraphSpec(
            "dflash_block", "DFlash block: [anchor, MASK...] -> logits of every block position",
            DFlashBlockGraph(drafter, draft_vocab),
            [("block_ids", torch.long, ["batch", "block"]), ("position_ids", torch.long, ["batch", "block"]),
             ("past_mask", torch.bool, ["batch", "block", "past"])] + caches,
            [("logits", ["batch", "block", vocab]), ("hidden", ["batch", "block", c.hidden_size])],
            example_sizes={"block": c.block_size},
        )
        return [ingest, block]
    gamma = c.block_size
    block = GraphSpec(
        "dspark_block", "DSpark block: backbone, Markov chain, confidence, ConfidenceTruncate",
        DSparkBlockGraph(drafter, draft_vocab),
        [("block_ids", torch.long, ["batch", gamma]), ("position_ids", torch.long, ["batch", gamma]),
         ("past_mask", torch.bool, ["batch", gamma, "past"])] + caches + [
            ("temperature", torch.float32, ["batch"]),
            ("gumbel", torch.float32, ["batch", gamma, vocab]),
            ("threshold", torch.float32, []),
            ("sps", torch.float32, ["sps_len"]),
        ],
        [("tokens", ["batch", gamma]), ("markov_logits", ["batch", gamma, vocab]),
         ("conf_logits", ["batch", gamma]), ("survival", ["batch", gamma]), ("draft_length", ["batch"])],
    )
    return [ingest, block]


# -- export, save, validate ---------------------------------------------------------------------------
@dataclass
class ExportedGraph:
    name: str
    description: str
    path: Path
    data_path: Path | None
    seconds: float
    custom_ops: list[str]
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    runtime: str = "any"  # "onnxruntime": uses ORT contrib ops (specrt.export.ort_fused); TensorRT skips it


def _set_shape(value, shape: Sequence[Any]) -> None:
    import onnx_ir as ir

    value.shape = ir.Shape([d if isinstance(d, int) else ir.SymbolicDim(d) for d in shape])


def _attach_ir_functions(model) -> list[str]:
    """Add the bodies of the specrt ops the ir.Model uses (for its own default-domain opset)."""
    import onnx_ir as ir

    from specrt.plugins import onnx_ops

    used = sorted({node.op_type for node in model.graph.all_nodes() if node.domain == onnx_ops.DOMAIN})
    opset = model.graph.opset_imports.get("", model.opset_imports.get(""))
    for name in used:
        function = ir.serde.deserialize_function(onnx_ops.function_proto(name, opset))
        model.functions[function.identifier()] = function
    if used:
        model.graph.opset_imports[onnx_ops.DOMAIN] = onnx_ops.DOMAIN_VERSION
    return used


def _io_description(values) -> list[dict[str, Any]]:
    out = []
    for v in values:
        dims = [d if isinstance(d, int) else str(d) for d in v.shape]
        out.append({"name": v.name, "dtype": _ONNX_DTYPE_NAMES.get(int(v.dtype), str(v.dtype)), "shape": dims})
    return out


def export_graph(
    spec: GraphSpec,
    folder: Path,
    opset: int = DEFAULT_OPSET,
    external_data: str = "auto",
) -> ExportedGraph:
    """Export one graph to folder/<name>.onnx (+ .onnx.data), attach the specrt functions, validate."""
    import onnx_ir as ir

    from specrt.plugins import onnx_ops

    opset = onnx_ops.check_opset(opset)
    start = time.perf_counter()
    spec.module.eval()
    args = spec.example_args()
    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry_log.level
    registry_log.setLevel(logging.ERROR)  # "torchvision is not installed" notes on every export
    with warnings.catch_warnings(), onnx_ops.registered_schemas(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                spec.module, args, dynamo=True, opset_version=opset, optimize=True, verbose=False,
                input_names=[name for name, _, _ in spec.inputs],
                output_names=[name for name, _ in spec.outputs],
                dynamic_shapes=spec.dynamic_shapes(),
                custom_translation_table=onnx_ops.translation_table(),
            )
        except SpecrtError:
            raise
        except Exception as err:  # the exporter's errors are long; keep the cause
            raise RuntimeError(f"torch.onnx.export failed for graph '{spec.name}': {err}") from err
        finally:
            registry_log.setLevel(level)
    model = program.model
    inputs = {v.name: v for v in model.graph.inputs}
    outputs = {v.name: v for v in model.graph.outputs}
    for name, _, shape in spec.inputs:
        _set_shape(inputs[name], shape)
    for name, shape in spec.outputs:
        _set_shape(outputs[name], shape)
    custom_ops = _attach_ir_functions(model)
    model.producer_name = "specrt"
    weight_bytes = sum(int(v.const_value.nbytes) for v in model.graph.initializers.values()
                       if v.const_value is not None)
    use_external = external_data == "always" or (external_data == "auto" and weight_bytes > EXTERNAL_DATA_THRESHOLD)
    path = folder / f"{spec.name}.onnx"
    data_path = folder / f"{spec.name}.onnx.data" if use_external else None
    ir.save(model, path, external_data=data_path.name if data_path else None)
    io_in, io_out = _io_description(model.graph.inputs), _io_description(model.graph.outputs)
    del program, model
    validate_graph(path)
    return ExportedGraph(spec.name, spec.description, path, data_path, time.perf_counter() - start,
                         [f"specrt::{op}" for op in custom_ops], io_in, io_out)


def save_onnx(model, path: Path, external_data: bool) -> Path | None:
    """Save an onnx.ModelProto as path (+ path.data when external_data), replacing what was there;
    returns the external-data path or None."""
    import onnx

    path = Path(path)
    data_path = path.with_name(f"{path.name}.data")
    for stale in (path, data_path):
        stale.unlink(missing_ok=True)
    if not external_data:
        onnx.save_model(model, str(path))
        return None
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_path.name, size_threshold=1024)
    return data_path


def validate_graph(path: Path) -> None:
    """check_model(full_check), strict shape inference, and the op-domain audit; raises on failure."""
    import onnx

    from specrt.plugins import onnx_ops

    path = Path(path)
    onnx.checker.check_model(str(path), full_check=True)
    with tempfile.TemporaryDirectory() as tmp:
        onnx.shape_inference.infer_shapes_path(str(path), str(Path(tmp) / "inferred.onnx"),
                                               check_type=True, strict_mode=True, data_prop=True)
    problems = onnx_ops.audit_domains(onnx.load(str(path), load_external_data=False))
    if problems:
        raise RuntimeError(f"{path.name} uses ops a plain ONNX runtime cannot run: {'; '.join(problems)}")


def graph_specs(target: LlamaModel, drafter=None, dtype: torch.dtype = torch.float32,
                draft_vocab: torch.Tensor | None = None) -> list[GraphSpec]:
    """The target graph (with the drafter's taps) and the drafter's graphs, ready to export
    (draft_vocab: a DFlash/DSpark block head over these target ids, see `drafter_specs`)."""
    if drafter is not None:
        target.set_taps(drafter.config.tap_layers)
        if isinstance(drafter, Eagle3Drafter):
            if drafter.embed_tokens is None and drafter.target_embed_weight is None:
                drafter.bind_target_embedding(target.embed_tokens)
        elif drafter.target_embed_weight is None or drafter.target_lm_head_weight is None:
            drafter.bind_target(target.embed_tokens, target.lm_head)
    else:
        target.set_taps(())
    specs = [target_spec(target, dtype)]
    if drafter is not None:
        specs += drafter_specs(drafter, dtype, draft_vocab)
    return specs


def check_draft_vocab(token_ids, vocab_size: int) -> torch.Tensor:
    """A block drafter's reduced vocabulary as int64 target ids: 1-D, ascending, unique, in range."""
    ids = torch.as_tensor(token_ids)
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1 or ids.numel() < 1:
        raise SpecrtError(f"a draft vocabulary must be a 1-D list of integer target ids, got {ids.dtype} "
                          f"of shape {tuple(ids.shape)}", "pass the target ids to keep")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or bool((ids[1:] <= ids[:-1]).any()):
        raise SpecrtError(f"a draft vocabulary must hold ascending, unique target ids in 0..{vocab_size - 1}",
                          "sort the ids and drop duplicates and out-of-range ones")
    return ids


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise SpecrtError(f"unsupported export dtype {name!r}", "use fp32 or fp16")
    return _DTYPES[name]


__all__ = [
    "GraphSpec", "ExportedGraph", "TargetGraph", "Eagle3FcGraph", "Eagle3StepGraph", "BlockIngestGraph",
    "DFlashBlockGraph", "DSparkBlockGraph", "attend", "target_spec", "drafter_specs", "graph_specs",
    "export_graph", "validate_graph", "save_onnx", "DEFAULT_OPSET", "EXAMPLE_DIMS",
]
