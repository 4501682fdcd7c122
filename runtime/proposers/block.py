"""Block proposers: DFlash and DSpark draft a whole chain in one drafter forward pass.

Context: after each round the target's taps of the newly committed tokens are turned into the
drafter's context K/V (`ingest_context`) at their absolute positions; slot = position, so the
drafter's cache mirrors the target's. Drafting: the block [anchor, MASK x (Bk-1)] sits at positions
p .. p+Bk-1 (p = the anchor's position), sees every context slot < p and the whole block
(non-causal), and writes its own K/V into slots p.. which the next ingest overwrites.

DFlash: block index k predicts position p+k, so logits[:, 1:] are the Bk-1 drafts; at T > 0 each
draft is sampled from q_k = `probabilities(logits_k, sampling)` (positions are independent given
the block, so x_k ~ q_k holds exactly as chain verification needs).
DSpark: gamma drafts through the Markov head (sequential in k), then confidence truncation: keep
the longest prefix whose calibrated survival prod sigmoid(z_i / T_i) stays >= `threshold`.

All rows of the batch run together; rows that are not drafting this round get a dummy block at
position 0 (their requests are finished, so overwriting their slots costs nothing).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specrt.export.models.dflash import DFlashDrafter
from specrt.export.models.dspark import DSparkDrafter
from specrt.runtime.proposers.base import Proposal
from specrt.runtime.sampling import SamplingParams, probabilities, sample


def pad_rows(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Stack [n_b, ...] tensors to [B, max n, ...] by repeating each row's last entry.

    Repeating (instead of zeros) makes padded entries rewrite the same slot with the same values,
    so padding can never clobber real context.
    """
    lengths = [int(t.shape[0]) for t in tensors]
    longest = max(lengths)
    out = []
    for t in tensors:
        if t.shape[0] < longest:
            t = torch.cat([t, t[-1:].expand(longest - t.shape[0], *t.shape[1:])], dim=0)
        out.append(t)
    return torch.stack(out), lengths


class BlockProposer:
    def __init__(self, drafter: DFlashDrafter, threshold: float = 0.0, max_drafts: int | None = None) -> None:
        self.drafter = drafter
        self.is_dspark = isinstance(drafter, DSparkDrafter) or getattr(drafter, "kind", None) == "dspark"
        self.name = "dspark" if self.is_dspark else "dflash"
        self.tap_layers = tuple(drafter.config.tap_layers)
        self.block_size = drafter.config.block_size
        # a verify step costs about its token count on a CPU: capping the chain trades tau for step cost
        self.max_drafts = min(drafter.num_drafts, max_drafts) if max_drafts else drafter.num_drafts
        self.threshold = float(threshold)
        self.device = drafter.device if hasattr(drafter, "device") else drafter.fc.weight.device
        self.last_survival: torch.Tensor | None = None  # [B, gamma] of the last DSpark round

    def reset(self, batch_size: int, capacity: int) -> None:
        self.batch_size = batch_size
        self.k_cache, self.v_cache = self.drafter.new_cache(batch_size, capacity + self.block_size)
        self.lengths = [0] * batch_size

    def context_length(self, row: int) -> int:
        return self.lengths[row]

    @torch.inference_mode()
    def observe(self, rows, tokens, taps, next_tokens) -> None:
        positions = [torch.arange(self.lengths[b], self.lengths[b] + len(t)) for b, t in zip(rows, tokens)]
        if len(rows) == self.batch_size and list(rows) == list(range(self.batch_size)):
            tap_batch, _ = pad_rows(list(taps))
            pos_batch, _ = pad_rows(positions)
            self.drafter.ingest_context(tap_batch.to(self.device), pos_batch.to(self.device),
                                        self.k_cache, self.v_cache, pos_batch.to(self.device))
        else:  # a subset of rows: ingest row by row into their cache rows
            for b, tap, pos in zip(rows, taps, positions):
                self.drafter.ingest_context(tap[None].to(self.device), pos[None].to(self.device),
                                            self.k_cache[:, b:b + 1], self.v_cache[:, b:b + 1], pos[None].to(self.device))
        for b, t in zip(rows, tokens):
            self.lengths[b] += len(t)

    @torch.inference_mode()
    def propose(self, rows, anchors, sampling: SamplingParams, generator) -> list[Proposal]:
        batch, bk = self.batch_size, self.block_size
        anchor = torch.zeros(batch, dtype=torch.long)
        start = torch.zeros(batch, dtype=torch.long)
        for b, a in zip(rows, anchors):
            anchor[b], start[b] = a, self.lengths[b]
        positions = start[:, None] + torch.arange(bk)[None, :]
        window = int(start.max()) + bk
        slots = torch.arange(window)[None, None, :]
        mask = (slots < start[:, None, None]) | ((slots >= start[:, None, None]) & (slots < (start + bk)[:, None, None]))
        mask = mask.expand(batch, bk, window)
        block = self.drafter.block_ids(anchor).to(self.device)
        args = (block, positions.to(self.device), mask.to(self.device), self.k_cache, self.v_cache, positions.to(self.device))
        if self.is_dspark:
            temperature = 0.0 if sampling.greedy else sampling.temperature
            tokens, probs, conf = self.drafter.draft(*args, temperature=temperature, generator=generator)
            survival = self.drafter.survival(conf)
            self.last_survival = survival
            keep = (survival >= self.threshold).long().cumprod(dim=-1).sum(dim=-1)
        else:
            logits, _ = self.drafter(*args)
            logits = logits[:, 1:]
            if sampling.greedy:
                tokens, probs = logits.argmax(-1), None
            else:
                probs = probabilities(logits, sampling)
                tokens = sample(probs, generator)
            # survival estimate: running product of each position's top draft probability; it never
            # looks at the drawn token, so a scheduler reading it keeps sampling lossless
            if probs is None:
                scores = logits.float()
                top = torch.exp(scores.amax(-1) - torch.logsumexp(scores, -1))
            else:
                top = probs.amax(-1)
            survival = top.cumprod(dim=-1)
            # DFlash's survival is uncalibrated (top-prob product) but, like DSpark's, it never depends on
            # the drawn tokens, so truncating on it keeps verification lossless
            keep = (survival >= self.threshold).long().cumprod(dim=-1).sum(dim=-1)
        keep = keep.clamp(max=self.max_drafts)
        out = []
        for b in rows:
            n = int(keep[b])
            out.append(Proposal.chain(tokens[b, :n].cpu(), None if probs is None else probs[b, :n].cpu(),
                                      survival[b, :n].float().cpu()))
        return out
