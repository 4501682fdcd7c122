"""ONNX Runtime backend: an engine folder (`specrt export`) loaded into sessions, run by the common loop.

    engines = load_engines("engines/SmolLM2-135M-Instruct-dspark", SessionOptions(device="cpu", threads=2))
    engine = OrtTargetEngine(engines.target, capacity=2048)
    proposer = engines.proposer(DraftOptions())          # None for a target-only folder

The target engine is the torch backend's slot-cache engine (`TorchTargetEngine`: K/V buffers
[L, B, Hkv, C, D] allocated once, new tokens written at length[b] + t, commit / rollback by
gathering kept rows) around `OrtTargetModel`, so verification, rollback and batching are the same
code on both backends; only the forward pass runs in ONNX Runtime. Per step the graph reads the
cache window [0, max length + T) in place and returns T new rows per layer, which are written into
the buffers: the cost grows with the context the attention reads, never with a cache copy
(`specrt bench --kv-contexts 64,1024` measures the per-step time at both contexts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specrt.plugins.errors import SpecrtError
from specrt.export.draft_options import from_manifest
from specrt.export.manifest import EngineManifest, load_manifest
from specrt.export.ort_fused import CAUSAL_GRAPH_NAME, GRAPH_NAME
from specrt.runtime.backends.ort_decode import BoundTargetCall, attention_rows
from specrt.runtime.backends.ort_models import (OrtBlockDrafter, OrtEagle3Drafter, OrtTargetModel, read_draft_vocab,
                                                spec_takes_attention_rows)
from specrt.runtime.backends.ort_session import LazyGraph, OrtGraph, SessionOptions
from specrt.runtime.backends.torch_backend import TorchTargetEngine

# the fused target graph and its causal twin, for plain decoding in one-row calls (specrt.export.ort_fused)
FUSED_GRAPH, CAUSAL_GRAPH = GRAPH_NAME, CAUSAL_GRAPH_NAME
_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class OrtTargetEngine(TorchTargetEngine):
    """The slot-cache TargetEngine over an `OrtTargetModel` (see the module docstring).

    Single-stream calls on the fused graph (plain decoding steps, verify steps, prefill) take
    `BoundTargetCall`: the same call with the cache bound once and the few inputs that change written
    in place (`specrt.runtime.backends.ort_decode`). `lean_decode` False sends them down the general
    path (the bench and the tests compare both)."""

    lean_decode = True
    _bound: BoundTargetCall | None = None
    _lengths_of: torch.Tensor | None = None  # the `lengths` tensor _lengths_np views
    _lengths_np: np.ndarray | None = None

    def forward(self, input_ids, position_ids, new_mask, logit_rows=None):
        # the bound call runs no torch op that records autograd; the general path is inference_mode
        if self.lean_decode and self.batch_size == 1:
            call = self._bound_call()
            if call is not None:
                out = call.forward(input_ids, position_ids, new_mask, logit_rows, self.lengths.item())
                if out is not None:
                    return out
        return super().forward(input_ids, position_ids, new_mask, logit_rows)

    def decode_one(self, token: int, argmax: bool = False) -> tuple[torch.Tensor | int, torch.Tensor | None] | None:
        """A plain step of the lone row, committed: `token` at the row's committed length through the
        bound call, with no mask, id or position tensors built (plain decoding runs this every token).
        (logits [1, 1, V], taps [1, 1, W] | None), the same as `forward` + `commit(0, [0])`, or None
        where `forward` must take the step (a batch, the general path, the cache end). argmax: the
        logits' argmax (an int) in place of the logits, all in numpy (`BoundTargetCall.decode`)."""
        if not self.lean_decode or self.batch_size != 1:
            return None
        call = self._bound_call()
        lengths = self._lengths_array()
        length = int(lengths[0])
        if call is None or length + call.rows > call.slots:
            return None
        out = call.decode(token, length, length, argmax)
        lengths[0] = length + 1
        return out

    def _lengths_array(self) -> np.ndarray:
        """`lengths` as numpy, sharing its memory: numpy's item access is a fraction of torch's, which
        counts here, right after a call has pushed the interpreter's code and data out of the caches."""
        if self._lengths_of is not self.lengths:  # reset() replaced the tensor
            self._lengths_of, self._lengths_np = self.lengths, self.lengths.numpy()
        return self._lengths_np

    def _bound_call(self) -> BoundTargetCall | None:
        """The bound call of the current cache and taps, where the fused graph takes this engine's calls."""
        model = self.model
        if model.fused is None or self.device.type != "cpu":
            return None
        if model.full_copy_row:
            return None  # its one-token calls run a full copy row: the general path builds it
        call = self._bound
        if (call is None or call.k_cache is not self.k_cache or call.taps != bool(model.tap_layers)
                or call.rows != attention_rows(model)):
            call = self._bound = BoundTargetCall(model, self.k_cache, self.v_cache)
        return call


@dataclass
class OrtEngines:
    folder: Path
    manifest: EngineManifest
    target: OrtTargetModel
    drafter: Any  # OrtEagle3Drafter | OrtBlockDrafter | None
    drafter_kind: str | None
    tokenizer: Any  # ChatTokenizer
    options: SessionOptions

    @property
    def name(self) -> str:
        return str(self.manifest.data.get("name", self.folder.name))

    def proposer(self, options=None, lookup_only: bool = False, measured: str | None = None):
        """The folder's drafter as a proposer (None without one); lookup_only: the drafter-free
        lookup proposer instead, which needs no drafter graph.

        measured "auto": per round the fastest of plain steps, the copies alone and the folder's
        drafter (`specrt.runtime.proposers.auto`; what `--drafter auto` runs); "named": the proposer
        above, measured against the others in probe rounds (a note when it was the slower choice)."""
        from specrt.runtime.proposers.factory import lookup_proposer, measured_proposer

        options = with_folder_lookup(options or from_manifest(self.manifest.data), self.folder, self.target,
                                     vocab_size=int(self.target.config.vocab_size))
        if measured not in (None, "auto", "named"):
            raise ValueError(f"measured must be None, 'auto' or 'named', got {measured!r}")
        if lookup_only:
            return lookup_proposer(options) if measured is None else measured_proposer(
                options, None, None if measured == "auto" else "copies")
        drafter = self._drafter_proposer(options)
        if measured is None:
            return drafter
        return measured_proposer(options, drafter, "drafter" if measured == "named" and drafter is not None else None)

    def _drafter_proposer(self, options):
        from specrt.runtime.proposers.factory import proposer_for

        if self.drafter is None:
            return None
        if self.target.two_row_decode:
            if self.drafter_kind == "eagle3" and options.tree_top_k > 1:
                options = exact_chain_options(options)
            elif self.drafter_kind != "eagle3" and options.block_tree_top_k > 1:
                options = exact_block_chain_options(options)
        # int8-activation engines are exact on chains only: one chain per step, not a tree of both
        return proposer_for(self.drafter_kind, self.drafter, options, chain_only=self.target.two_row_decode)


def spinning_policy(options: SessionOptions) -> tuple[SessionOptions, SessionOptions]:
    """(target graph options, drafter graph options) where the caller left `spinning` to us (None).

    The target's pool spins between the kernels of a call (ORT's default, and onnxruntime-genai's): a
    one-token call runs ~400 small kernels, and waking a sleeping thread for each costs ~25% of it on
    idle cores. The drafter's graphs never spin: two spinning pools on the same cores take turns at
    them (measured on the int4 EAGLE-3 folder, 6 MT-bench prompts, greedy: 1.39x plain with both
    spinning against 1.72x). Stopping the target's spinning as soon as its call returns (ORT's
    session.force_spinning_stop) measured no faster with a drafter loaded (greedy: 1.72x either way on
    EAGLE-3, 1.77x against 1.80x on DSpark) and slower where the drafter seldom runs (temperature 1,
    EAGLE-3: 0.91x of plain against 0.95x): the next one-token call then wakes its threads. On cores
    other processes keep busy, spinning threads lose their time slices and the same calls run up to 2x
    slower: set `spinning=False` there. A user who sets `spinning` gets it on every graph."""
    import dataclasses

    if options.spinning is not None:
        return options, options
    return dataclasses.replace(options, spinning=True), dataclasses.replace(options, spinning=False)


def with_folder_lookup(options, folder, target=None, vocab_size: int | None = None):
    """options with the folder's calibrated copy hit rates (lookup.json) and copy datastore
    (datastore.npz), where it has them and the caller set none (`specrt calibrate` writes both;
    `specrt export` too for a target with shipped data), and the copies' shape for the target model
    that verifies them (an `OrtTargetModel`; None: an engine exact on trees):

    - chains only where the engine is exact on chains only (int8 activations with a proposer:
      `two_row_decode`); elsewhere two disagreeing copies can be verified side by side;
    - a one-token copy verified whatever its odds only where one-token calls run a whole second row
      anyway (`full_copy_row`): with attention rows a copy costs a verify row like any other."""
    import dataclasses

    from specrt.runtime.proposers.datastore import load_datastore_for
    from specrt.runtime.proposers.lookup_prior import load_prior_for

    changes = {}
    if options.lookup_prior is None:
        changes["lookup_prior"] = load_prior_for(folder)
    if options.lookup_datastore is None:
        changes["lookup_datastore"] = load_datastore_for(folder, vocab_size)
    if getattr(target, "full_copy_row", False):
        changes["lookup_free_first"] = True
    if not getattr(target, "two_row_decode", False):
        changes["lookup_tree"] = True
    return dataclasses.replace(options, **changes) if changes else options


def exact_chain_options(options):
    """EAGLE-3 as a chain (top-1 per depth) on engines with int8 activations (MatMulNBits accuracy
    level 4). There a row's logits are bitwise reproducible only when the row sees its context in the
    layout plain decoding gives it (committed slots, then itself): a tree row that skips a sibling's
    slot sums its attention in another order, the int8 activation rounding amplifies that to ~1
    logit, and greedy output would drift from plain decoding (measured: 3/24 identical with a 2/2/4
    tree, 3/3 with chains; docs/exactness.md). Chains keep speculation exact."""
    import dataclasses
    import logging

    logging.getLogger("specrt").warning(
        "int8-activation engine: EAGLE-3 drafts a chain (tree top-k %d -> 1) so the output stays identical "
        "to plain decoding", options.tree_top_k)
    return dataclasses.replace(options, tree_top_k=1, tree_tokens=options.tree_depth + 1)


def exact_block_chain_options(options):
    """DFlash/DSpark trees fall back to chains on int8-activation engines, for the reason above."""
    import dataclasses
    import logging

    logging.getLogger("specrt").warning(
        "int8-activation engine: the block drafter drafts a chain (block tree top-k %d -> 1) so the output stays "
        "identical to plain decoding", options.block_tree_top_k)
    return dataclasses.replace(options, block_tree_top_k=1)


def load_engines(folder: str | Path, options: SessionOptions | None = None, with_drafter: bool = True,
                 verify_checksums: bool = True, use_fused: bool = True, lookup_only: bool = False,
                 exact_plain: bool = True) -> OrtEngines:
    """Validate the manifest (checksums included) and open one session per graph.

    use_fused: run single streams on the folder's ORT-fused target graph when it has one (CPU); the
    portable graph then loads on the first batched call. False: the portable graph only.
    lookup_only: no drafter graph is loaded, but the target will verify copied drafts.
    exact_plain: without a proposer, int8-activation engines decode with attention rows, so plain text
    is the speculative decoder's; False keeps one-row calls (the fastest plain decoding, `--fast-plain`).
    Plain decoding in one-row calls (fp32 engines, or exact_plain False) runs on the folder's causal
    graph (`target_ort_causal`) in place of `target_ort`: the same logits, ~10% less per step."""
    from specrt.export.tokenizer import chat_tokenizer_from_folder

    options = options or SessionOptions()
    folder = Path(folder)
    manifest = load_manifest(folder, verify_checksums=verify_checksums)
    data = manifest.data
    drafting = with_drafter and manifest.drafter_kind is not None
    target_options, drafter_options = spinning_policy(options)
    dtype_name = (data.get("export") or {}).get("dtype", "float32")
    if dtype_name not in _CACHE_DTYPES:
        raise SpecrtError(f"{folder}: weights of dtype {dtype_name!r} are not supported by the ORT backend",
                          "re-export with --dtype fp32 or fp16")
    cache_dtype = _CACHE_DTYPES[dtype_name]
    if options.device == "cpu" and cache_dtype == torch.float16:
        raise SpecrtError(f"{folder} holds fp16 graphs, which ONNX Runtime's CPU provider runs slowly or not at all",
                          "re-export with --dtype fp32 for a CPU, or run with --device cuda")
    graphs = manifest.graphs

    def graph(name: str, options: SessionOptions = drafter_options) -> OrtGraph:
        if name not in graphs:
            raise SpecrtError(f"{folder}/manifest.json lists no graph {name!r}", "re-export the engine folder")
        return OrtGraph(manifest.graph_path(name), graphs[name], options)

    target_cfg = manifest.target_config
    # GroupQueryAttention's CUDA kernel takes fp16/bf16 only and is untested here: CPU first
    fused_spec = graphs.get(FUSED_GRAPH) if use_fused and options.device == "cpu" else None
    weights = (data.get("export") or {}).get("weights") or {}
    # int8 activations: MatMulNBits at accuracy level 4, and w8a8's per-token int8 rows
    # (specrt.export.integer_matmul: its sums are exact, but its rounding amplifies attention's)
    w8a8 = weights.get("weights") == "w8a8"
    int8_activations = bool(weights.get("bits")) and (int(weights.get("accuracy_level", 0)) == 4 or w8a8)
    # Such engines never make a one-row attention call, on the fused graph (the portable one splits
    # attention at the committed/new boundary, so its sums depend on how the context was fed whatever
    # the row count): one-token steps run attention rows (`specrt.export.ort_fused`; int4, 80 MT-bench
    # prompts: 0.92x of one-row speed, two full rows ~0.82x), with a proposer (a drafter, or copies
    # alone: lookup_only) and, unless exact_plain is off, without one. Folders exported before
    # attention rows: with a proposer one-token steps run a full copy row (`full_copy_row`: it carries
    # a free one-token copy); plain int4/int8 keeps one-row calls (text not that of speculation) and
    # w8a8 decodes two rows (its second row costs ~nothing there: 99.0 vs 97.5 tok/s).
    speculating = drafting or lookup_only
    takes_rows = fused_spec is not None and spec_takes_attention_rows(fused_spec)
    two_row_decode = int8_activations and fused_spec is not None and (speculating or (w8a8 and not takes_rows))
    attention_row_decode = int8_activations and takes_rows and not two_row_decode and exact_plain
    fused = None
    if fused_spec is not None:
        # plain decoding in one-row calls makes causal calls only: the causal twin serves them at ~10%
        # less per token (specrt.export.ort_fused), with the same logits bitwise
        one_row_plain = not speculating and not two_row_decode and not attention_row_decode
        fused = graph(CAUSAL_GRAPH if one_row_plain and CAUSAL_GRAPH in graphs else FUSED_GRAPH, target_options)
    portable = (LazyGraph(manifest.graph_path("target"), graphs["target"], target_options) if fused
                else graph("target", target_options))
    target = OrtTargetModel(portable, target_cfg, data["target"].get("tap_layers", []), cache_dtype, fused)
    target.two_row_decode = two_row_decode
    target.attention_row_decode = attention_row_decode
    # batches of such engines on the portable graph change a request's text against its text alone
    # (docs/exactness.md): one fused call per row keeps it (OrtTargetModel)
    target.per_row_batches = int8_activations and fused is not None
    drafter, kind = None, manifest.drafter_kind
    if drafting:
        section = data["drafter"]
        cfg = manifest.drafter_config
        roles = section.get("graphs", {})
        if kind == "eagle3":
            vocab_file = (section.get("draft_vocab") or {}).get("file", "draft_to_target.npy")
            ids = np.load(folder / vocab_file)
            drafter = OrtEagle3Drafter(graph(roles.get("fc", "eagle3_fc")), graph(roles.get("step", "eagle3_step")),
                                       cfg, ids, cache_dtype)
        else:
            drafter = OrtBlockDrafter(kind, graph(roles.get("ingest", f"{kind}_ingest")),
                                      graph(roles.get("block", f"{kind}_block")), cfg, cache_dtype,
                                      section.get("sts_temperatures"),
                                      read_draft_vocab(folder, section, int(target_cfg.vocab_size)))
    tokenizer = chat_tokenizer_from_folder(folder, list(target_cfg.eos_token_ids))
    return OrtEngines(folder, manifest, target, drafter, kind if drafter is not None else None, tokenizer, options)
