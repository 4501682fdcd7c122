"""The target: an own, minimal Llama-family decoder written for export.

Call contract (shared by prefill, decode and tree verification; DESIGN.md section 2):

    logits, taps = model(input_ids, position_ids, attn_mask, k_cache, v_cache, write_slots, logit_rows)

    input_ids    [B, T]        int64   new tokens (T = prompt length, 1, or tree size)
    position_ids [B, T]        int64   RoPE positions (tree tokens: prefix length + depth)
    attn_mask    [B, T, S]     bool    True where new token t may attend cache slot s; S <= capacity
                                       is the window read, and must cover the new tokens' slots
    k_cache      [L, B, Hkv, C, D]     fixed-capacity cache, written in place at write_slots
    v_cache      [L, B, Hkv, C, D]
    write_slots  [B, T]        int64   cache slot of each new token
    logit_rows   [B, R] int64 or None  rows of T that need logits (None: all rows)

    logits       [B, R, V]     float32
    taps         [B, T, n_taps * H]    hidden_states[i] for i in `tap_layers`, concatenated
                                       (hidden_states[0] = embeddings, [i] = output of layer i-1;
                                       [L] is the last layer's raw output, before the final norm,
                                       unlike transformers' last hidden state)

The per-step cost does not include copying the cache: K/V of the new tokens are scattered into
their slots and attention reads a window (a view) of the cache.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from specrt.export.models.config import LlamaConfig
from specrt.export.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding, gather_rows


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            bias=cfg.attention_bias, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, k_cache, v_cache, write_slots, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, write_slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Llama 2/3, Qwen2/2.5 (qkv bias), Qwen3 (qk-norm); tied or untied LM head."""

    def __init__(self, cfg: LlamaConfig, tap_layers: Sequence[int] = ()) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.tap_layers: tuple[int, ...] = ()
        self.set_taps(tap_layers)

    def set_taps(self, tap_layers: Sequence[int]) -> None:
        """Choose which hidden_states indices the forward returns (0 = embeddings, L = last layer)."""
        taps = tuple(int(i) for i in tap_layers)
        bad = [i for i in taps if not 0 <= i <= self.config.num_layers]
        if bad:
            from specrt.plugins.errors import SpecrtError

            raise SpecrtError(
                f"tap layers {bad} are outside hidden_states[0..{self.config.num_layers}] of this target",
                "pick tap indices between 0 (embeddings) and the number of layers",
            )
        self.tap_layers = taps

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        device = self.embed_tokens.weight.device
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_slots: torch.Tensor,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids)
        # hidden_states[0] is the embedding output, hidden_states[i] the output of layer i-1
        collected: dict[int, torch.Tensor] = {0: x} if 0 in self.tap_layers else {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, k_cache[i], v_cache[i], write_slots, attn_mask)
            if i + 1 in self.tap_layers:
                collected[i + 1] = x
        if logit_rows is not None:
            x = gather_rows(x, logit_rows)
        logits = self.lm_head(self.norm(x)).float()
        if not self.tap_layers:
            return logits, None
        return logits, torch.cat([collected[i] for i in self.tap_layers], dim=-1)
