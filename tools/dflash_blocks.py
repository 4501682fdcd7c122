"""The blocks DFlash and DSpark drafters learn on: anchors, block inputs and masks, labels, weights.

Shared by training (`specrt.tools.train_dflash`) and STS calibration (`specrt.tools.calibrate_sts`),
which replays the same blocks over held-out data.
"""

from __future__ import annotations

import torch

from specrt.export.models.dflash import DFlashDrafter


# -- anchors, masks, labels -------------------------------------------------------------------------
def sample_anchors(prompt_lengths: torch.Tensor, lengths: torch.Tensor, num_blocks: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_blocks` distinct anchors per sample from P .. N-2 (sorted); [B, nb] and validity."""
    b = len(lengths)
    anchors = torch.zeros(b, num_blocks, dtype=torch.long)
    valid = torch.zeros(b, num_blocks, dtype=torch.bool)
    for row in range(b):
        lo, hi = int(prompt_lengths[row]), int(lengths[row]) - 2
        count = hi - lo + 1
        if count <= 0:
            continue
        take = min(count, num_blocks)
        pick = torch.randperm(count, generator=generator)[:take].sort().values + lo
        anchors[row, :take] = pick
        valid[row, :take] = True
    return anchors, valid


def block_attention_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """[B, nb*Bk, ctx_len + nb*Bk] bool: block n sees context slots < a_n and its own Bk slots.

    Blocks that are padding (valid False) see only their own slots (no context), so no row is empty.
    """
    b, nb = anchors.shape
    q = nb * block_size
    q_block = torch.arange(q) // block_size  # [Q]
    slot = torch.arange(ctx_len + q)
    anchor_of_q = torch.gather(anchors, 1, q_block[None, :].expand(b, -1))  # [B, Q]
    valid_of_q = torch.gather(valid, 1, q_block[None, :].expand(b, -1))
    context = (slot[None, None, :] < ctx_len) & (slot[None, None, :] < anchor_of_q[:, :, None]) & valid_of_q[:, :, None]
    own = (slot[None, :] >= ctx_len) & (((slot[None, :] - ctx_len) // block_size) == q_block[:, None])  # [Q, S]
    return context | own[None]


def block_inputs(drafter: DFlashDrafter, tokens: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor):
    """Block ids [B, nb*Bk] ([anchor, MASK...] per block) and positions [B, nb*Bk] (a_n + k)."""
    bk = drafter.config.block_size
    b, nb = anchors.shape
    ids = torch.full((b, nb, bk), drafter.config.mask_token_id, dtype=torch.long)
    ids[:, :, 0] = torch.where(valid, torch.gather(tokens, 1, anchors), torch.full_like(anchors, drafter.config.mask_token_id))
    positions = anchors[:, :, None] + torch.arange(bk)[None, None, :]
    return ids.reshape(b, nb * bk), positions.reshape(b, nb * bk)


def packed_block_hidden(drafter: DFlashDrafter, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                        valid: torch.Tensor) -> torch.Tensor:
    """All blocks of each sequence in one forward -> post-norm hidden [B, nb, Bk, H].

    Context K/V of every position are written once per layer (`ingest_context`); the blocks are
    appended after them (slots T ..) and read them under `block_attention_mask`.
    """
    cfg = drafter.config
    b, t, _ = taps.shape
    nb, bk = anchors.shape[1], cfg.block_size
    q = nb * bk
    dtype = drafter.fc.weight.dtype
    shape = (b, cfg.num_kv_heads, t + q, cfg.head_dim)
    k_cache = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
    v_cache = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
    ctx_pos = torch.arange(t).expand(b, t)
    drafter.ingest_context(taps, ctx_pos, k_cache, v_cache, ctx_pos)
    ids, positions = block_inputs(drafter, tokens, anchors, valid)
    slots = (t + torch.arange(q)).expand(b, q)
    mask = block_attention_mask(anchors, valid, t, bk)
    hidden = drafter.backbone(ids, positions, mask, k_cache, v_cache, slots)
    return hidden.reshape(b, nb, bk, -1)


def block_labels(tokens: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 block_size: int, label_shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """labels [B, nb, Bk] (token at a+k+shift), their positions, and the supervised mask.

    Supervised: a draft (k + shift >= 1) whose position is inside the sequence (a contiguous prefix,
    since anchors lie in the response, every later position is a response token).
    """
    k = torch.arange(block_size)
    pos = anchors[:, :, None] + k[None, None, :] + label_shift
    n = tokens.shape[1]
    labels = torch.gather(tokens[:, None, :].expand(-1, anchors.shape[1], -1), 2, pos.clamp(max=n - 1))
    mask = valid[:, :, None] & (pos <= (lengths - 1)[:, None, None]) & ((k + label_shift) >= 1)[None, None, :]
    return labels, pos, mask


def position_weights(block_size: int, label_shift: int, gamma: float) -> torch.Tensor:
    """exp(-(d-1)/gamma) for draft number d = k + shift >= 1, 0 for the DFlash anchor slot."""
    d = torch.arange(block_size, dtype=torch.float32) + label_shift
    return torch.where(d >= 1, torch.exp(-(d - 1) / gamma), torch.zeros_like(d))


# -- the objectives ---------------------------------------------------------------------------------
