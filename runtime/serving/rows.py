"""Row-level access to a target engine and a proposer, for requests that join and leave a batch.

The `TargetEngine` protocol runs every forward over all B rows of its cache. A server with B slots
and few requests would then compute B rows per step; a new request's prefill would drag every
running row along as padding (and could overrun the cache: padding of a long row sits past its
length). Both backends share one engine class (`TorchTargetEngine`, the ORT engine subclasses it)
whose state is a cache [L, B, Hkv, C, D] and a lengths tensor [B]: slicing both along B gives an
engine over rows lo..hi-1 that reads and writes the same memory (each layer's view stays
contiguous, which the ORT backend binds by pointer). `row_view` builds that; for an engine it does
not know it returns None and the batcher falls back to whole-batch steps (slower, same tokens).

Proposers (`BlockProposer`, `Eagle3Proposer`) keep per-row Python state (`lengths`, EAGLE-3 root
logits) and per-row caches; `proposer_prefix_view` gives one over rows 0..hi-1 sharing the lists
(same objects, so a prefix keeps the indices right) and slicing the caches. A row is reset by
zeroing its committed length: stale K/V past the length is never attended to.
"""

from __future__ import annotations

import copy


def _slot_engine(engine) -> bool:
    lengths = getattr(engine, "lengths", None)
    k = getattr(engine, "k_cache", None)
    return k is not None and getattr(engine, "v_cache", None) is not None and lengths is not None \
        and k.dim() == 5 and k.shape[1] == engine.batch_size and lengths.shape[0] == engine.batch_size


def supports_views(engine) -> bool:
    return _slot_engine(engine)


def row_view(engine, lo: int, hi: int):
    """An engine over rows lo..hi-1 sharing the cache and the lengths (no copy), or None."""
    if not _slot_engine(engine):
        return None
    if lo == 0 and hi == engine.batch_size:
        return engine
    view = copy.copy(engine)
    view.k_cache = engine.k_cache[:, lo:hi]
    view.v_cache = engine.v_cache[:, lo:hi]
    view.lengths = engine.lengths[lo:hi]  # a view: commits through it update the engine's lengths
    view.batch_size = hi - lo
    return view


def proposer_prefix_view(proposer, hi: int):
    """The proposer over rows 0..hi-1 (shared per-row lists, sliced caches), or the proposer itself."""
    if proposer is None or hi >= getattr(proposer, "batch_size", hi):
        return proposer
    if hasattr(proposer, "prefix_view"):  # a wrapper (WithLookup) slices what it wraps
        return proposer.prefix_view(hi)
    k, v = getattr(proposer, "k_cache", None), getattr(proposer, "v_cache", None)
    if k is None or v is None or k.dim() != 5:
        return proposer
    view = copy.copy(proposer)  # shallow: `lengths` and the other per-row lists stay the same objects
    view.k_cache, view.v_cache = k[:, :hi], v[:, :hi]
    view.batch_size = hi
    return view


def reset_engine_row(engine, row: int) -> None:
    """Forget row `row`: its committed length goes to 0 (the protocol's lengths tensor, in place)."""
    engine.lengths[row] = 0


def reset_proposer_row(proposer, row: int) -> None:
    """Forget row `row` of a proposer: `reset_row` when it has one, else its per-row length."""
    if proposer is None:
        return
    if hasattr(proposer, "reset_row"):
        proposer.reset_row(row)
        return
    proposer.lengths[row] = 0
    for name in ("root_logits", "root_hidden"):  # EAGLE-3: the next observe sets them again
        state = getattr(proposer, name, None)
        if isinstance(state, list):
            state[row] = None


def forward_active_runs(engine, ids, positions, mask, active: list[int], sizes: list[int]):
    """A verify step over rows 0..hi-1 that computes only the `active` rows: one forward per run of
    consecutive active rows, each on a row view trimmed to its run's longest real input (`sizes[row]`
    tokens). For engines that run one call per row anyway (`OrtTargetModel.per_row_batches`), where an
    idle row in the range would otherwise cost a whole one-token call. Idle rows get zero logits and
    taps, which nobody reads; a lone row is called on exactly its own tokens, as it would be alone."""
    hi = ids.shape[0]
    logits_out, taps_out = None, None
    for lo, end in runs(active):
        t = max(sizes[lo:end])
        view = row_view(engine, lo, end)
        logits, taps = view.forward(ids[lo:end, :t], positions[lo:end, :t], mask[lo:end, :t, :t])
        if logits_out is None:
            logits_out = logits.new_zeros((hi, ids.shape[1]) + tuple(logits.shape[2:]))
            if taps is not None:
                taps_out = taps.new_zeros((hi, ids.shape[1]) + tuple(taps.shape[2:]))
        logits_out[lo:end, :t] = logits
        if taps_out is not None:
            taps_out[lo:end, :t] = taps
    return logits_out, taps_out


def runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted rows -> maximal runs of consecutive rows as (lo, hi) half-open ranges."""
    out: list[tuple[int, int]] = []
    for r in sorted(rows):
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out
