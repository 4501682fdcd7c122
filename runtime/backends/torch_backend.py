"""Torch backend: the reference `TargetEngine`, on CPU or GPU.

The cache is one pair of tensors [L, B, Hkv, C, D] allocated once. Each forward writes the new
tokens' K/V at slots length[b] + t and attends over the window [0, max(length) + T); rows of a
batch that are shorter see their own committed slots only. Nothing in a step copies the cache.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specrt.export.models.llama import LlamaModel
from specrt.runtime.engine import check_capacity


class TorchTargetEngine:
    def __init__(
        self,
        model: LlamaModel,
        capacity: int,
        batch_size: int = 1,
        cache_dtype: torch.dtype | None = None,
        spare_slots: int = 64,
    ) -> None:
        self.model = model
        self.config = model.config
        self.capacity = int(capacity)
        # slots past `capacity` that only uncommitted tokens use: padding rows of a batch and the
        # drafts of a row near the end write there, so they never collide with committed K/V
        self.spare_slots = int(spare_slots)
        # a torch LlamaModel, or anything with its call contract and `device` / `dtype` (the ORT backend)
        weight = getattr(getattr(model, "embed_tokens", None), "weight", None)
        self.device = weight.device if weight is not None else model.device
        self.cache_dtype = cache_dtype or (weight.dtype if weight is not None else model.dtype)
        self.reset(batch_size)

    def set_taps(self, tap_layers: Sequence[int]) -> None:
        self.model.set_taps(tap_layers)

    def reset(self, batch_size: int) -> None:
        self.batch_size = int(batch_size)
        if getattr(self, "k_cache", None) is None or self.k_cache.shape[1] != self.batch_size:
            self.k_cache, self.v_cache = self.model.new_cache(
                self.batch_size, self.capacity + self.spare_slots, self.cache_dtype
            )
        self.lengths = torch.zeros(self.batch_size, dtype=torch.long)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        new_mask: torch.Tensor,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = input_ids.shape
        check_capacity(self.lengths, t, self.capacity + self.spare_slots)
        lengths = self.lengths
        window = int(lengths.max()) + t
        slots = lengths[:, None] + torch.arange(t)[None, :]
        # committed part: slot s < length[b]; new part: the new tokens' own slots, per new_mask
        committed = torch.arange(window)[None, :] < lengths[:, None]  # [B, S]
        mask = committed[:, None, :].expand(b, t, window).clone()
        mask.scatter_(2, slots[:, None, :].expand(b, t, t), new_mask)
        dev = self.device
        logits, taps = self.model(
            input_ids.to(dev), position_ids.to(dev), mask.to(dev), self.k_cache, self.v_cache, slots.to(dev),
            None if logit_rows is None else logit_rows.to(dev),
        )
        return logits, taps

    def commit(self, row: int, kept: Sequence[int]) -> None:
        """Keep new tokens `kept` (indices into the last forward's T, ascending) of `row`."""
        kept = list(kept)
        if kept != list(range(len(kept))):  # a prefix (a chain, a plain step) is already in place
            base = int(self.lengths[row])
            with torch.inference_mode():
                src = torch.tensor([base + i for i in kept], device=self.device)
                dst = torch.arange(base, base + len(kept), device=self.device)
                # gather first (index_select copies), so overlapping src/dst cannot clobber each other
                self.k_cache[:, row, :, dst] = self.k_cache[:, row, :, src].clone()
                self.v_cache[:, row, :, dst] = self.v_cache[:, row, :, src].clone()
        self.lengths[row] += len(kept)
