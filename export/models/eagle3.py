"""EAGLE-3 drafter (reference: SafeAILab/EAGLE `eagle/model/cnets.py`, arXiv 2503.01840).

Module and tensor names follow the official checkpoint, so a SafeAILab state dict loads 1:1:
`fc`, `midlayer.{input_layernorm,hidden_norm,self_attn.{q,k,v,o}_proj,post_attention_layernorm,
mlp.{gate,up,down}_proj}`, `norm`, `lm_head`, buffers `d2t`/`t2d`, optional `embed_tokens`.

Call contract (same explicit-cache style as the target, `specrt.export.models.llama`):

    h0 = drafter.fuse(taps)                    taps [B, T, 3*Ht] = target hidden_states[tap_layers]
    logits, out = drafter(input_ids, hidden, position_ids, attn_mask, k_cache, v_cache, write_slots)

    input_ids    [B, T]  int64   the token *after* the one whose feature is in `hidden`
    hidden       [B, T, H]       fuse(taps) on the first draft step, the drafter's own `out` after
    position_ids [B, T]  int64   RoPE positions (official EAGLE: row j, which holds the feature of
                                 token j, sits at position j; tree nodes: parent position + 1)
    attn_mask    [B, T, S] bool  True = may attend cache slot s; must cover the rows' own slots
    k_cache      [1, B, Hkv, C, D]  the drafter's one-layer cache, written in place at write_slots
    v_cache      [1, B, Hkv, C, D]
    write_slots  [B, T]  int64
    -> logits    [B, T, draft_vocab] float32 over the reduced draft vocabulary
       out       [B, T, H]       pre-norm output; the next step's `hidden`

Label convention: row j combines the feature of token j with the embedding of token j+1 and
predicts token j+2 (draft ids; map them with `draft_to_target`).

Math of the single decoder layer (`midlayer`):
    x   = cat(input_layernorm(embed(ids)), hidden_norm(hidden))          [B, T, 2H]
    h1  = hidden + o_proj(attention(q/k/v projected from x))             residual is `hidden`
          (`norm_before_residual`, the speculators / vLLM variant: residual is hidden_norm(hidden))
    out = h1 + mlp(post_attention_layernorm(h1));  logits = lm_head(norm(out))

Embedding: official Llama EAGLE-3 checkpoints carry no embedding and use the target's, so by
default `embed_tokens` is None and `bind_target_embedding` stores the target's weight as a
non-persistent, gradient-free buffer (it is not saved with the drafter and moves with `.to()`).
Bind after the target has its final dtype/device. A checkpoint with `embed_tokens.weight` (needed
when the drafter's hidden size differs from the target's) gets its own frozen `embed_tokens`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig, fill_attention_dims
from specrt.export.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding, gather_rows


def default_eagle3_taps(num_target_layers: int) -> list[int]:
    """hidden_states indices the official EAGLE-3 taps: low, middle and high (2, L//2, L-3)."""
    n = num_target_layers
    return [2, n // 2, n - 3]


@dataclass
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (length of t2d)
    draft_vocab_size: int  # rows of lm_head (length of d2t)
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    target_hidden_size: int = 0  # 0 -> hidden_size; fc is (3 * target_hidden_size) -> hidden_size
    tap_layers: list[int] = field(default_factory=list)  # target hidden_states indices, 3 of them
    max_position_embeddings: int = 4096
    own_embedding: bool = False  # True: the checkpoint carries embed_tokens.weight
    # speculators / vLLM variant: the residual around attention is hidden_norm(hidden), not hidden
    norm_before_residual: bool = False
    # the checkpoint format it was loaded from (provenance for the manifest; not part of the math)
    checkpoint_format: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        fill_attention_dims(self, "EAGLE-3 config", "check the drafter's config.json")
        if not self.target_hidden_size:
            self.target_hidden_size = self.hidden_size
        self.tap_layers = [int(i) for i in self.tap_layers]
        if self.draft_vocab_size > self.vocab_size:
            raise SpecrtError(
                f"EAGLE-3 config: draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})",
                "the draft vocabulary must be a subset of the target vocabulary",
            )

    num_layers = 1  # EAGLE-3 has one decoder layer (`midlayer`)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Eagle3Config":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def for_target(
        cls, target_cfg: LlamaConfig, draft_vocab_size: int, intermediate_size: int | None = None
    ) -> "Eagle3Config":
        """A drafter with the target's width, heads and RoPE, tapping hidden_states (2, L//2, L-3)."""
        return cls(
            hidden_size=target_cfg.hidden_size,
            num_heads=target_cfg.num_heads,
            num_kv_heads=target_cfg.num_kv_heads,
            head_dim=target_cfg.head_dim,
            intermediate_size=intermediate_size or target_cfg.intermediate_size,
            rms_norm_eps=target_cfg.rms_norm_eps,
            rope_theta=target_cfg.rope_theta,
            rope_scaling=target_cfg.rope_scaling,
            vocab_size=target_cfg.vocab_size,
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=target_cfg.hidden_size,
            tap_layers=default_eagle3_taps(target_cfg.num_layers),
            max_position_embeddings=target_cfg.max_position_embeddings,
        )


class Eagle3MidLayer(nn.Module):
    """The one decoder layer; q/k/v read the 2H-wide cat(embedding, feature)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, emb, hidden, cos, sin, k_cache, v_cache, write_slots, mask):
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        residual = normed if self.norm_before_residual else hidden
        h1 = residual + self.self_attn(x, cos, sin, k_cache, v_cache, write_slots, mask)
        return h1 + self.mlp(self.post_attention_layernorm(h1))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        if cfg.own_embedding:
            self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, h)
            self.embed_tokens.weight.requires_grad_(False)
        else:
            self.embed_tokens = None
        # the target's embedding weight once bound: frozen, not part of the drafter's checkpoint
        self.register_buffer("target_embed_weight", None, persistent=False)
        # draft id -> target id offset, and the target ids that are in the draft vocabulary
        d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True  # identity map until a real one is loaded
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    # -- embedding -------------------------------------------------------------------------
    def bind_target_embedding(self, embedding: nn.Embedding) -> None:
        """Use the target's (frozen) input embedding; required unless the drafter has its own."""
        weight = embedding.weight if isinstance(embedding, nn.Embedding) else embedding
        want = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != want:
            raise SpecrtError(
                f"the target embedding is {tuple(weight.shape)}, this EAGLE-3 drafter needs {want} "
                "(vocab_size, hidden_size)",
                "use the drafter trained for this target, or a drafter checkpoint that carries its "
                "own embed_tokens.weight",
            )
        self.target_embed_weight = weight.detach()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        if self.target_embed_weight is None:
            raise SpecrtError(
                "this EAGLE-3 drafter has no embedding of its own and none was bound",
                "call drafter.bind_target_embedding(target.embed_tokens) before running it",
            )
        return F.embedding(input_ids, self.target_embed_weight)

    # -- graph pieces ----------------------------------------------------------------------
    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, T, 3*Ht] (target hidden_states at tap_layers, concatenated) -> [B, T, H]."""
        return self.fc(taps.to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_slots: torch.Tensor,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, rows, draft_vocab], out [B, T, H]); logit_rows [B, rows]: the rows whose logits
        are wanted (default all T). A context ingest needs the last row's only, and the head over the
        draft vocabulary is most of a row's cost."""
        emb = self.embed(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(position_ids)
        out = self.midlayer(emb, hidden, cos, sin, k_cache[0], v_cache[0], write_slots, attn_mask)
        rows = out if logit_rows is None else gather_rows(out, logit_rows)
        logits = self.lm_head(self.norm(rows)).float()
        return logits, out

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids: target = draft + d2t[draft]."""
        return draft_ids + self.d2t[draft_ids]

    def new_cache(
        self, batch: int, capacity: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        shape = (1, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        device = self.fc.weight.device
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
