"""Exported graphs behind the call contracts of the torch modules, so one loop serves both backends.

The speculative loop, the target engine and the proposers call the torch models through a small
contract (`specrt.export.models`): the caller owns K/V caches [L, B, Hkv, C, D], gives the slots
the new tokens are written to (`write_slots` [B, T]) and one attention mask over the cache window
that already includes those slots (`attn_mask` [B, T, W]); the model writes the new K/V in place
and attends. The exported graphs split the same information differently (see
`specrt.export.onnx_export`): they read the cache window through `past_mask` [B, T, W], see the new
tokens through `tree_mask` [B, T, T], and return the new K/V instead of writing them.
`split_window_mask` converts one form into the other and `write_new_kv` does the write, so the
classes here are drop-in replacements for LlamaModel, Eagle3Drafter, DFlashDrafter and
DSparkDrafter in `TorchTargetEngine`, `Eagle3Proposer` and `BlockProposer`.

Caches stay torch tensors (on the CPU, or the GPU for the CUDA EP); `OrtGraph` binds each layer's
[B, Hkv, C, D] view by pointer, so no step copies the cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig
from specrt.export.models.layers import gather_rows
from specrt.runtime.backends.ort_session import OrtGraph


def split_window_mask(attn_mask: torch.Tensor, write_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """attn_mask [B, T, W] over slots (own slots included) -> (past_mask [B, T, W], tree_mask [B, T, T]).

    past_mask hides the new tokens' own slots (they hold stale K/V until the graph's output is
    written); tree_mask[b, t, u] = attn_mask[b, t, write_slots[b, u]]. When several new tokens
    write the same slot (padding repeats a row's last entry), only the first is visible, so a
    token never attends the same key twice - as in the torch model, where they collapse into one slot.
    """
    b, t, w = attn_mask.shape
    slots = write_slots.to(attn_mask.device)
    # one spare False column: a slot outside the window (none of the callers make one) reads False
    padded = torch.cat([attn_mask, attn_mask.new_zeros(b, t, 1)], dim=-1)
    index = slots.clamp(max=w)[:, None, :].expand(b, t, t)
    tree = padded.gather(2, index)
    past = padded.scatter(2, index, torch.zeros_like(index, dtype=torch.bool))[..., :w]
    first = torch.ones(b, t, dtype=torch.bool, device=attn_mask.device)
    if t > 1:
        same = slots[:, :, None] == slots[:, None, :]  # [B, T, T]
        earlier = torch.tril(torch.ones(t, t, dtype=torch.bool, device=attn_mask.device), diagonal=-1)
        first = ~(same & earlier).any(-1)
    return past, tree & first[:, None, :]


def write_new_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
                 write_slots: torch.Tensor) -> None:
    """k_cache [L, B, Hkv, C, D][:, b, :, write_slots[b, t]] = new_keys[:, b, :, t] (and values)."""
    slots = write_slots.to(k_cache.device)
    for b in range(slots.shape[0]):
        k_cache[:, b].index_copy_(2, slots[b], new_keys[:, b].to(k_cache.dtype))
        v_cache[:, b].index_copy_(2, slots[b], new_values[:, b].to(v_cache.dtype))


def cache_feeds(k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict[str, torch.Tensor]:
    """past_key_i / past_value_i: each layer's [B, Hkv, C, D] view (contiguous when B == 1 or the
    cache is laid out [L, B, ...], which is what `new_cache` allocates)."""
    feeds = {}
    for i in range(k_cache.shape[0]):
        feeds[f"past_key_{i}"] = k_cache[i]
        feeds[f"past_value_{i}"] = v_cache[i]
    return feeds


class CacheFeeds:
    """`cache_feeds` of the cache a drafter was last called with, kept: handed the same view objects
    every call, `OrtGraph.run` skips re-checking and re-binding them (2 x layers inputs a call)."""

    def __init__(self) -> None:
        self.key = None
        self.feeds: dict[str, torch.Tensor] = {}

    def __call__(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict[str, torch.Tensor]:
        key = (k_cache.data_ptr(), v_cache.data_ptr(), tuple(k_cache.shape))
        if key != self.key:  # the views hold their cache alive, so a pointer names one cache
            self.key, self.feeds = key, cache_feeds(k_cache, v_cache)
        return self.feeds


class OrtTargetModel:
    """The exported target graph with LlamaModel's call contract (see the module docstring).

    With an ORT-fused graph (`target_ort`, `specrt.export.ort_fused`) single-stream calls (batch 1, new
    tokens in the slots right after the committed ones: every call `TorchTargetEngine` makes) run
    that graph: GroupQueryAttention reads the committed slots and writes the new K/V into the cache
    buffers in place, the tree mask travels as an additive bias. Batches run the portable graph.
    Both graphs compute the same function; their float rounding differs, so a request gives the
    same greedy text alone and in a batch except at near-ties (as with any kernel change).

    `per_row_batches` (int8-activation engines): there the rounding differences are not rare near-ties
    but change the text within a few dozen tokens (int8 activation rounding amplifies them), so a
    batch runs as one fused call per row, each on its own cache row with its real tokens only (padding
    dropped): a request then computes exactly what it computes alone, which is what makes batched
    greedy output equal its output alone there. It costs the batched graph's shared weight reads.
    """

    def __init__(self, graph, config: LlamaConfig, tap_layers: Sequence[int], cache_dtype: torch.dtype,
                 fused: OrtGraph | None = None):
        self.graph = graph  # OrtGraph, or a LazyGraph when `fused` serves single streams
        self.fused = fused
        # the fused graph runs attention over more rows than tokens (`specrt.export.ort_fused`,
        # "attention rows"); folders exported before that cannot (read once: one-token calls ask)
        self.takes_attention_rows = fused is not None and spec_takes_attention_rows(fused.spec)
        # the fused graph is the causal twin (`target_ort_causal`): prompts, plain steps and chains only;
        # other calls take the portable graph
        self.causal_only = fused is not None and not any(i["name"] == "attention_bias"
                                                         for i in fused.spec.get("inputs", []))
        self.config = config
        self.exported_taps = tuple(int(i) for i in tap_layers)
        self.tap_layers = self.exported_taps
        self.device = graph.device
        self.dtype = cache_dtype
        self.fused_calls = 0  # how many forwards took the fused graph (tests, diagnostics)
        self._views: dict[tuple, tuple[dict, dict]] = {}  # cache key -> (past_* feeds, present_* buffers)
        self._views_of = None  # storage pointer of the one cache _views (and the fused graph's bindings) belong to
        self.per_row_batches = False  # batches as one fused call per row (class docstring)
        # one-token calls take the multi-row path: on for int8-activation engines with a proposer,
        # where it is what makes speculative output equal plain output; as attention rows where the
        # fused graph takes them, else as a full copy row (`with_copy_row`, `full_copy_row`); fp32
        # engines agree without it (measured)
        self.two_row_decode = False
        # one-row calls with two attention rows only (see with_attention_row): the same exactness at
        # ~one row's cost, for plain decoding on int8-activation engines whose fused graph takes it
        self.attention_row_decode = False


    @property
    def exact_decode(self) -> bool:
        """One-token calls reproduce a verify step's row bitwise (int8-activation engines)."""
        return self.two_row_decode or self.attention_row_decode

    @property
    def full_copy_row(self) -> bool:
        """One-token calls run a whole second row (`with_copy_row`; folders whose fused graph takes no
        attention rows), which can carry a one-token copy at no extra cost."""
        return self.two_row_decode and not self.takes_attention_rows

    def set_taps(self, tap_layers: Sequence[int]) -> None:
        taps = tuple(int(i) for i in tap_layers)
        if taps and taps != self.exported_taps:
            raise SpecrtError(
                f"the engine's target graph returns taps {list(self.exported_taps)}, the drafter needs {list(taps)}",
                "export the target together with this drafter (specrt export --drafter KIND --drafter-ckpt PATH)",
            )
        self.tap_layers = taps

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None):
        c = self.config
        shape = (c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim)
        dtype = dtype or self.dtype
        return torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device)

    def __call__(self, input_ids, position_ids, attn_mask, k_cache, v_cache, write_slots, logit_rows=None):
        b, t = input_ids.shape
        if logit_rows is None:
            logit_rows = torch.arange(t).expand(b, t)
        if b > 1 and self.per_row_batches and self.fused is not None:
            return self._call_per_row(input_ids, position_ids, attn_mask, k_cache, v_cache, write_slots, logit_rows)
        room = b == 1 and t == 1 and attn_mask.shape[-1] < k_cache.shape[-2]  # a spare slot for the copy
        # a fused graph that takes attention rows gives the token's row of a two-row call at one row's
        # cost in its linear layers (`with_attention_row`): plain and speculative one-token calls use it
        if room and self.exact_decode and self.takes_attention_rows and self._fits_fused(attn_mask, write_slots):
            ids, rows_positions, rows_mask = with_attention_row(input_ids, position_ids, attn_mask, write_slots)
            return self._call_fused(ids, rows_positions, rows_mask, k_cache, v_cache, logit_rows)
        copy_row = self.two_row_decode and room
        if copy_row:
            input_ids, position_ids, attn_mask, write_slots = with_copy_row(input_ids, position_ids, attn_mask,
                                                                            write_slots)
        if self.fused is not None and self._fits_fused(attn_mask, write_slots) and (
                not self.causal_only or self._fits_causal(position_ids, attn_mask)):
            logits, taps = self._call_fused(input_ids, position_ids, attn_mask, k_cache, v_cache, logit_rows)
        else:
            logits, taps = self._call_portable(input_ids, position_ids, attn_mask, k_cache, v_cache, write_slots,
                                               logit_rows)
        if taps is not None and copy_row:
            taps = taps[:, :1]  # the copy row's taps are not the caller's
        return logits, taps

    def _cache_views(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[dict, dict]:
        """past_* feeds and present_* output buffers of these caches, built once per cache (every step of
        an engine passes the same buffers) rather than 4 x layers tensor views per call."""
        key = (k_cache.data_ptr(), v_cache.data_ptr(), tuple(k_cache.shape))
        views = self._views.get(key)
        if views is None:
            # views of one cache only (its row slices included): the views keep a dropped cache alive
            base = k_cache.untyped_storage().data_ptr()
            if base != self._views_of:
                self._views.clear()
                self._views_of = base
                if self.fused is not None:  # its per-row bindings hold the old cache too
                    self.fused.drop_bindings()
            feeds = cache_feeds(k_cache, v_cache)
            bound = {name.replace("past_", "present_", 1): view for name, view in feeds.items()}
            views = self._views[key] = (feeds, bound)
        return views

    def _call_per_row(self, input_ids, position_ids, attn_mask, k_cache, v_cache, write_slots, logit_rows):
        """A batch as one call per row (`per_row_batches`). A row's real tokens are its first one and
        every later one that sees it (drafts see their anchor, prompt tokens the first; padding sees
        only itself), a prefix of the row; padding rows get zero logits and taps, which nobody reads."""
        b, t = input_ids.shape
        first = write_slots[:, 0].to(attn_mask.device)
        sees_first = attn_mask.gather(2, first.view(b, 1, 1).expand(b, t, 1))[..., 0]
        counts = (1 + sees_first[:, 1:].sum(1)).tolist()
        logits_out, taps_out = None, None
        for r, n in enumerate(counts):
            window = int(first[r]) + n
            logits, taps = self(input_ids[r:r + 1, :n], position_ids[r:r + 1, :n], attn_mask[r:r + 1, :n, :window],
                                k_cache[:, r:r + 1], v_cache[:, r:r + 1], write_slots[r:r + 1, :n],
                                logit_rows[r:r + 1].clamp(max=n - 1))
            if logits_out is None:
                logits_out = logits.new_zeros((b,) + tuple(logits.shape[1:]))
                taps_out = None if taps is None else taps.new_zeros((b, t) + tuple(taps.shape[2:]))
            logits_out[r] = logits[0]
            if taps_out is not None:
                taps_out[r, :n] = taps[0]
        return logits_out, taps_out

    def _call_portable(self, input_ids, position_ids, attn_mask, k_cache, v_cache, write_slots, logit_rows):
        past_mask, tree_mask = split_window_mask(attn_mask, write_slots)
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "past_mask": past_mask,
                 "tree_mask": tree_mask, "logit_rows": logit_rows, **self._cache_views(k_cache, v_cache)[0]}
        out = self.graph.run(feeds)
        write_new_kv(k_cache, v_cache, out["new_keys"], out["new_values"], write_slots)
        taps = out.get("taps") if self.tap_layers else None
        return out["logits"], taps

    @staticmethod
    def _fits_fused(attn_mask: torch.Tensor, write_slots: torch.Tensor) -> bool:
        """Batch 1, new tokens in consecutive slots ending the window (GroupQueryAttention's layout)."""
        if write_slots.shape[0] != 1:
            return False
        t, window = write_slots.shape[1], attn_mask.shape[-1]
        start = window - t
        return start >= 0 and bool((write_slots[0] == torch.arange(start, window, device=write_slots.device)).all())

    @staticmethod
    def _fits_causal(position_ids: torch.Tensor, attn_mask: torch.Tensor) -> bool:
        """A `_fits_fused` call the causal twin expresses: every committed slot visible to every new token,
        the new ones causal among themselves, at the positions of their slots."""
        from specrt.runtime.backends.ort_decode import is_causal_run

        t, window = attn_mask.shape[-2], attn_mask.shape[-1]
        return bool(attn_mask[0, :, :window - t].all()) and is_causal_run(position_ids, attn_mask[:, :, window - t:],
                                                                           window - t)

    def _call_fused(self, input_ids, position_ids, attn_mask, k_cache, v_cache, logit_rows):
        total = attn_mask.shape[-1]
        caches, present = self._cache_views(k_cache, v_cache)
        feeds = {"input_ids": input_ids, "seqlens_k": torch.tensor([total - 1], dtype=torch.int32),
                 "total_sequence_length": torch.tensor(total, dtype=torch.int32), "logit_rows": logit_rows,
                 **caches}
        if not self.causal_only:
            bias = torch.zeros(attn_mask.shape, dtype=self.dtype, device=attn_mask.device)
            bias.masked_fill_(~attn_mask, float("-inf"))
            feeds.update(position_ids=position_ids, attention_bias=bias[:, None])
        # present_* share the cache's memory: the graph writes the t new rows at slots total-t .. total-1
        wanted = ["logits", "taps"] if self.tap_layers else ["logits"]
        # one IO binding per cache row: rows of a batch (`per_row_batches`) take turns without re-binding
        out = self.fused.run(feeds, wanted, present, binding=k_cache.data_ptr())
        self.fused_calls += 1
        return out["logits"], out.get("taps") if self.tap_layers else None


def spec_takes_attention_rows(spec: dict) -> bool:
    """The manifest entry of a fused graph that runs attention over more rows than tokens."""
    from specrt.export.ort_fused import ATTENTION_ROWS_DIM

    shape = next((i["shape"] for i in spec.get("inputs", []) if i["name"] == "position_ids"), [])
    return len(shape) == 2 and shape[1] == ATTENTION_ROWS_DIM


def with_attention_row(input_ids, position_ids, attn_mask, write_slots):
    """`with_copy_row`'s inputs for a fused graph that takes attention rows: the token once, its
    position and mask for two attention rows (the graph repeats the token's q|k|v for the second)."""
    _, positions, mask, _ = with_copy_row(input_ids, position_ids, attn_mask, write_slots)
    return input_ids, positions, mask


def with_copy_row(input_ids, position_ids, attn_mask, write_slots):
    """A one-token call as two rows: the token and a copy that sees only itself, written to the next
    (spare) slot, which the following call overwrites.

    Why (`OrtTargetModel.two_row_decode`, on for int8-activation engines with a proposer): a one-row
    GroupQueryAttention call multiplies probabilities by V in MLAS's one-row kernel, whose rounding
    differs from multi-row calls (`specrt.export.ort_fused`, attention rows); int8 activation rounding
    (MatMulNBits at accuracy level 4, w8a8) amplifies that to ~1 logit over the layers, so plain
    decoding would not reproduce a verify step. With a second row every call takes the multi-row path,
    where a row's result does not depend on the other rows (the linear layers' rows are bitwise
    independent of the row count: checked on MatMulNBits, 1-4 rows). The second row then carries a free
    one-token copy; plain decoding needs only attention's second row (`with_attention_row`).
    """
    window = attn_mask.shape[-1]
    mask = torch.zeros(1, 2, window + 1, dtype=torch.bool, device=attn_mask.device)
    mask[:, :, :window] = attn_mask
    mask[:, 1, window] = True
    slots = torch.cat([write_slots, torch.full_like(write_slots, window)], dim=1)
    return input_ids.repeat(1, 2), position_ids.repeat(1, 2), mask, slots


class OrtEagle3Drafter:
    """eagle3_fc + eagle3_step with Eagle3Drafter's contract (fuse, call, draft_to_target, new_cache)."""

    def __init__(self, fc: OrtGraph, step: OrtGraph, config, draft_to_target_ids: np.ndarray, cache_dtype: torch.dtype):
        self.fc_graph, self.step_graph = fc, step
        self.config = config
        self.device = step.device
        self.dtype = cache_dtype
        self.token_ids = torch.from_numpy(np.asarray(draft_to_target_ids, dtype=np.int64))
        if self.token_ids.shape[0] != config.draft_vocab_size:
            raise SpecrtError(
                f"draft_to_target.npy has {self.token_ids.shape[0]} entries, the drafter's vocabulary {config.draft_vocab_size}",
                "re-export the engine folder (specrt export --drafter eagle3 ...)",
            )
        self.embed_tokens = True  # the target embedding lives inside the step graph
        self.cache_feeds = CacheFeeds()
        # folders exported before the step graph took logit_rows compute every row's logits: the rows
        # asked for are then picked here
        self.takes_logit_rows = any(i["name"] == "logit_rows" for i in step.spec.get("inputs", []))

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        return self.fc_graph.run({"taps": taps.to(self.dtype)})["hidden"]

    def __call__(self, input_ids, hidden, position_ids, attn_mask, k_cache, v_cache, write_slots, logit_rows=None):
        """Eagle3Drafter's call: (logits [B, rows, draft_vocab] of `logit_rows` (default all), hidden [B, T, H])."""
        past_mask, tree_mask = split_window_mask(attn_mask, write_slots)
        feeds = {"input_ids": input_ids, "hidden": hidden.to(self.dtype), "position_ids": position_ids,
                 "past_mask": past_mask, "tree_mask": tree_mask, **self.cache_feeds(k_cache, v_cache)}
        if self.takes_logit_rows:
            b, t = input_ids.shape
            feeds["logit_rows"] = torch.arange(t).expand(b, t) if logit_rows is None else logit_rows
        out = self.step_graph.run(feeds)
        write_new_kv(k_cache, v_cache, out["new_keys"], out["new_values"], write_slots)
        logits = out["logits"]
        if logit_rows is not None and not self.takes_logit_rows:
            logits = gather_rows(logits, logit_rows)
        return logits, out["hidden_out"]

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.token_ids.to(draft_ids.device)[draft_ids]

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None):
        c = self.config
        shape = (1, batch, c.num_kv_heads, capacity, c.head_dim)
        dtype = dtype or self.dtype
        return torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device)


class DraftVocab:
    """A block head's reduced vocabulary (`specrt export --draft-vocab N`): draft id i is target id
    token_ids[i]. Drafted ids map back with `to_target`; a draft law q over the N ids becomes the law
    over the target's vocabulary it is (`scatter`: zero mass on every other token), which is what
    lossless verification compares with the target's p."""

    def __init__(self, token_ids: np.ndarray, vocab_size: int) -> None:
        self.token_ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))
        self.vocab_size = int(vocab_size)

    @property
    def size(self) -> int:
        return int(self.token_ids.shape[0])

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.token_ids.to(draft_ids.device)[draft_ids]

    def scatter(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [..., N] -> [..., V]."""
        full = probs.new_zeros(*probs.shape[:-1], self.vocab_size)
        return full.index_copy_(-1, self.token_ids.to(probs.device), probs)


def read_draft_vocab(folder: Path, section: dict, vocab_size: int) -> DraftVocab | None:
    """The block drafter's reduced vocabulary its manifest section names (`draft_vocab`), checked, or
    None for the full vocabulary. The manifest's checksums already vouch for the bytes; this refuses
    a file whose content cannot be a vocabulary (another target's, or written by hand)."""
    record = section.get("draft_vocab")
    if record is None:
        return None
    fix = "re-export the engine folder (specrt export --drafter KIND --draft-vocab N ...)"
    if not isinstance(record, dict) or not isinstance(record.get("file"), str):
        raise SpecrtError(f"{folder}/manifest.json: the drafter's draft_vocab entry is malformed", fix)
    path = Path(folder) / record["file"]
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise SpecrtError(f"{path} cannot be read as a draft vocabulary ({str(err).splitlines()[0][:200]})", fix) from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or ids.size == 0:
        raise SpecrtError(f"{path} holds {ids.dtype} of shape {ids.shape}, not a list of target ids", fix)
    if ids.size != record.get("size"):
        raise SpecrtError(f"{path} has {ids.size} ids, the manifest says {record.get('size')}", fix)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or bool((np.diff(ids) <= 0).any()):
        raise SpecrtError(f"{path} is not ascending unique target ids in 0..{vocab_size - 1}", fix)
    return DraftVocab(ids, vocab_size)


class OrtBlockDrafter:
    """{dflash,dspark}_ingest + {dflash,dspark}_block with DFlashDrafter's / DSparkDrafter's contract.

    With a reduced draft vocabulary (`draft_vocab`, `specrt export --draft-vocab N`) the block graph's
    logits cover those N tokens: the DFlash call returns them as they are (the proposer maps what it
    drafts, `BlockProposer`), the DSpark graph returns target ids and `draft` scatters its law to the
    full vocabulary.

    Cost of one drafting round before reduced vocabularies (int4 SmolLM2 folders, batch 1, 2 threads,
    ORT's profiler on the block graph): the LM head over 49152 tokens was ~80% of the DFlash block
    call (10.5 of 13.3 ms, 16 rows) and ~55% of DSpark's (6.2 of 11.4 ms, 7 rows), whose Markov W2
    (r -> V, once per position) and the V-wide adds, argmaxes and concats of its chain took another
    ~2.5 ms; the drafter layers ~1 ms; the ingest call ~1 ms a round; host work in the proposer
    (argmax / survival over [15, V] logits for DFlash) ~3 ms. All of the V-wide work shrinks by N / V.
    """

    def __init__(self, kind: str, ingest: OrtGraph, block: OrtGraph, config, cache_dtype: torch.dtype,
                 sts_temperatures: Sequence[float] | None = None, draft_vocab: DraftVocab | None = None) -> None:
        self.kind = kind
        self.ingest_graph, self.block_graph = ingest, block
        self.config = config
        self.device = block.device
        self.dtype = cache_dtype
        self.label_shift = 1 if kind == "dspark" else 0
        temps = sts_temperatures if sts_temperatures else [1.0] * config.block_size
        self.sts_temperatures = torch.tensor(list(temps), dtype=torch.float32)
        self.cache_feeds = CacheFeeds()
        self.draft_vocab = draft_vocab
        # the graph's logits width must be the vocabulary the runtime maps: a folder with a reduced head
        # loaded without its mapping (or the reverse) would draft wrong tokens
        self.logits_width = draft_vocab.size if draft_vocab is not None else int(config.vocab_size)
        name = "markov_logits" if kind == "dspark" else "logits"
        shape = next((o["shape"] for o in (getattr(block, "spec", None) or {}).get("outputs", [])
                      if o["name"] == name), None)
        if shape and isinstance(shape[-1], int) and shape[-1] != self.logits_width:
            raise SpecrtError(
                f"the {kind} block graph's {name} cover {shape[-1]} tokens, the runtime expected {self.logits_width} "
                f"({'a draft vocabulary of that size' if draft_vocab is not None else 'the full vocabulary'})",
                "load the folder with load_engines (it reads the drafter's draft_vocab), or re-export it",
            )

    @property
    def num_drafts(self) -> int:
        return self.config.block_size - 1 + self.label_shift

    def block_ids(self, anchor: torch.Tensor) -> torch.Tensor:
        block = torch.full((anchor.shape[0], self.config.block_size), self.config.mask_token_id, dtype=torch.long)
        block[:, 0] = anchor
        return block

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None):
        c = self.config
        shape = (c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim)
        dtype = dtype or self.dtype
        return torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device)

    def ingest_context(self, taps, position_ids, k_cache, v_cache, write_slots) -> None:
        out = self.ingest_graph.run({"taps": taps.to(self.dtype), "position_ids": position_ids})
        write_new_kv(k_cache, v_cache, out["new_keys"], out["new_values"], write_slots)

    def _past_mask(self, attn_mask, write_slots):
        # the block's own K/V never leave the graph: the window is the context before the block
        past_mask, _ = split_window_mask(attn_mask, write_slots)
        return past_mask

    def __call__(self, block_ids, position_ids, attn_mask, k_cache, v_cache, write_slots):
        if self.kind != "dflash":
            raise SpecrtError("a DSpark engine drafts through draft()", "this is a bug in the caller: please report")
        out = self.block_graph.run({"block_ids": block_ids, "position_ids": position_ids,
                                    "past_mask": self._past_mask(attn_mask, write_slots), **self.cache_feeds(k_cache, v_cache)})
        return out["logits"], out["hidden"]

    def draft(self, block_ids, position_ids, attn_mask, k_cache, v_cache, write_slots, temperature: float = 0.0,
              generator: torch.Generator | None = None, gumbel: torch.Tensor | None = None):
        """DSpark: tokens [B, gamma], draft probs softmax(l / T) or None, conf logits [B, gamma].

        Sampling inside the graph is Gumbel-max on noise drawn here from `generator`, so the
        runtime owns the random stream and the draws are exact samples of softmax(l / T).
        gumbel [B, gamma, N]: the caller's noise instead (seeded rows' coupled drafts), with
        temperature a [B] tensor (0: that row greedy); the tokens are then deterministic (probs None).
        """
        b, gamma = block_ids.shape
        vocab = self.logits_width
        coupled = gumbel is not None
        if coupled:
            temperatures = torch.as_tensor(temperature, dtype=torch.float32).expand(b).contiguous()
        else:
            temperatures = torch.full((b,), float(temperature), dtype=torch.float32)
            if temperature > 0:
                u = torch.rand((b, gamma, vocab), generator=generator).clamp_(1e-20, 1.0 - 1e-7)
                gumbel = -torch.log(-torch.log(u))
            else:
                gumbel = torch.zeros((b, gamma, vocab))
        feeds = {
            "block_ids": block_ids, "position_ids": position_ids, "past_mask": self._past_mask(attn_mask, write_slots),
            **self.cache_feeds(k_cache, v_cache),
            "temperature": temperatures,
            "gumbel": gumbel, "threshold": torch.tensor(0.0, dtype=torch.float32),
            "sps": torch.ones(1, dtype=torch.float32),  # M == 1: the threshold policy (the proposer applies it)
        }
        out = self.block_graph.run(feeds, ["tokens", "markov_logits", "conf_logits"])
        probs = torch.softmax(out["markov_logits"] / temperature, dim=-1) if not coupled and temperature > 0 else None
        if probs is not None and self.draft_vocab is not None:
            probs = self.draft_vocab.scatter(probs)  # the tokens are target ids already (the graph maps them)
        return out["tokens"], probs, out["conf_logits"]

    def survival(self, conf_logits: torch.Tensor) -> torch.Tensor:
        temps = self.sts_temperatures[: conf_logits.shape[-1]].to(conf_logits.device)
        return torch.cumprod(torch.sigmoid(conf_logits.float() / temps), dim=-1)
