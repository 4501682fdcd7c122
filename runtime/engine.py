"""The engine interface every backend implements, and the masks the loop hands it.

A `TargetEngine` owns a fixed-capacity K/V cache for B request rows and the committed length of
each row. One call, `forward`, serves prefill, decode and tree verification:

    logits, taps = engine.forward(input_ids, position_ids, new_mask, logit_rows)

    input_ids    [B, T] int64   new tokens of each row (rows shorter than T are padded; see below)
    position_ids [B, T] int64   RoPE positions
    new_mask     [B, T, T] bool which new tokens each new token sees (causal, or tree
                                ancestor-or-self); every row sees its whole committed cache
    logit_rows   [B, R] int64 | None   rows that need logits

The new tokens' K/V go to slots `length[b] + t` but are not committed: `commit(row, kept)` keeps
the listed new tokens (in order) and discards the rest. For a chain, kept = 0..n-1 and nothing
moves; for a tree the accepted path's K/V rows are gathered into contiguous slots first.
Padding tokens (when rows have different T) see only themselves and are never committed.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig


class TargetEngine(Protocol):
    config: LlamaConfig
    capacity: int
    batch_size: int
    lengths: torch.Tensor  # [B] int64, committed tokens per row

    def reset(self, batch_size: int) -> None: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        new_mask: torch.Tensor,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def commit(self, row: int, kept: Sequence[int]) -> None: ...

    def set_taps(self, tap_layers: Sequence[int]) -> None: ...


def causal_mask(batch: int, length: int, valid: Sequence[int] | None = None) -> torch.Tensor:
    """[B, T, T] lower-triangular mask; rows past valid[b] (padding) see only themselves."""
    mask = torch.tril(torch.ones(length, length, dtype=torch.bool)).expand(batch, length, length).clone()
    if valid is not None:
        eye = torch.eye(length, dtype=torch.bool)
        for b, n in enumerate(valid):
            mask[b, n:] = eye[n:]
    return mask


def check_capacity(lengths: torch.Tensor, new_tokens: int, capacity: int) -> None:
    longest = int(lengths.max()) + new_tokens if lengths.numel() else new_tokens
    if longest > capacity:
        raise SpecrtError(
            f"the sequence needs {longest} cache slots but the KV cache holds {capacity}",
            "shorten the prompt, lower --max-new-tokens, or raise --capacity "
            "(up to the model's max_position_embeddings)",
        )
