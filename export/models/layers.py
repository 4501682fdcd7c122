"""Building blocks shared by the target and the drafters: RMSNorm, RoPE, attention, SwiGLU MLP.

Written for export: no Python-side caches, no data-dependent control flow. The K/V cache is an
explicit tensor owned by the caller (see `specrt.runtime.kv_cache`); attention writes the new
tokens' K/V into their cache slots and then attends over a window of the cache under a boolean
mask, so one code path serves prefill, single-token decode and tree verification.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        # x / sqrt(.) rather than x * rsqrt(.): the exported Pow-ReduceMean-Add-Sqrt-Div chain is the pattern
        # ONNX Runtime fuses into one SimplifiedLayerNormalization kernel (rsqrt exports as Sqrt+Reciprocal+Mul)
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of RoPE, with the scalings the family uses (llama3, linear)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    from specrt.plugins.errors import SpecrtError

    raise SpecrtError(f"unsupported rope scaling {scaling!r}", "supported: llama3, linear, or none")


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary (tree) positions; computed per call so any position is allowed."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] -> cos, sin [B, 1, T, head_dim]
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # fp32 tables must not promote fp16/bf16 q/k
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, T, H] at rows [B, R] (indices into T) -> [B, R, H]: the rows whose logits are wanted."""
    return torch.gather(x, 1, rows[:, :, None].expand(-1, -1, x.shape[-1]))


def write_kv(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """cache [B, Hkv, C, D] <- new [B, Hkv, T, D] at slots [B, T], in place."""
    index = slots[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
    cache.scatter_(2, index, new.to(cache.dtype))


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, S, D], mask [B, T, S] bool (True = attend) -> [B, Hq, T, D].

    Grouped-query attention without materialising repeated K/V: queries are folded into
    [B, Hkv, group*T, D] so each K/V head is read once.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qg = q.reshape(b, hkv, group * t, d)
    maskg = mask[:, None, None, :, :].expand(b, hkv, group, t, mask.shape[-1]).reshape(b, hkv, group * t, -1)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=maskg)
    return out.reshape(b, hq, t, d)


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
        in_features: int | None = None,
    ) -> None:
        super().__init__()
        in_features = in_features or hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of x [B, T, in] as [B, Hkv, T, D], RoPE applied to K."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Write x's K/V into the caches at write_slots, then attend over the first mask.shape[-1] slots.

        k_cache/v_cache: [B, Hkv, C, D] (this layer's slice of the cache, mutated in place).
        """
        b, t, _ = x.shape
        q = self.project_q(x, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        write_kv(k_cache, write_slots, k)
        write_kv(v_cache, write_slots, v)
        window = mask.shape[-1]
        out = masked_attention(q, k_cache[:, :, :window].to(q.dtype), v_cache[:, :, :window].to(q.dtype), mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
