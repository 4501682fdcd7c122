"""Triton kernels for `specrt::TreeAttention` and for writing new K/V rows into the cache.

    out = tree_attention(query, key, value, past_key, past_value, past_mask, tree_mask, scale)
    write_kv(k_cache, v_cache, new_keys, new_values, slots)       # in place

`tree_attention` holds to the contract of specrt.plugins.tree_attention (the torch reference is the
judge in tests/test_triton_kernels.py): decode (T = 1) and tree verification (T > 1) over the first
S slots of a fixed-capacity cache, grouped-query attention, a past mask and a tree mask, float32 /
float16 / bfloat16 in, float32 math, fully masked rows -> zeros.

Design
------
* One program per (batch row, K/V head, block of BLOCK_M query rows). The query heads of one K/V head
  are folded into the rows (row r = g * T + t, query head h * G + g), as the ONNX body does, so each
  K/V tile is loaded once for the whole group and never repeated per query head.
* Flash-attention style online softmax over two key ranges - the cache window [0, S) under
  `past_mask`, then the T new tokens under `tree_mask` - so the [T, S + T] score matrix never exists.
  Masked scores are replaced by a large finite negative number and their probabilities multiplied
  by the mask, so a row that has seen nothing yet keeps m = -1e30, l = 0 and stays finite; the
  final 1/l is taken only where l > 0, which gives the contract's zeros for fully masked rows.
* float32 inputs use IEEE dot products (input_precision="ieee"): TF32 would cost ~1e-3 relative
  error against the reference; 16-bit inputs use the tensor cores with float32 accumulation.
* The kernel is read-only, like the op: it never writes the cache (see the contract: the graph
  returns the new K/V and the runtime writes only the rows it keeps). The in-place write the
  TensorRT backend needs is the separate `write_kv` kernel below, launched by the runtime after a
  step, so rejected drafts never touch the cache and a TensorRT engine never aliases its inputs.

Argument order: input pointers, int32 scalars, output pointer, then constexprs - the order in which
TensorRT's AOT plugins launch a kernel (specrt.plugins.triton_aot). Strides are arguments (in
elements) so the wrapper can pass views of a [L, B, Hkv, C, D] cache; the last dimension of every
tensor must be contiguous. Offsets are int32 arithmetic: caches up to 2^31 elements per layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from specrt.plugins.errors import SpecrtError

try:  # the kernels need triton; the module still imports without it (the wrappers then refuse)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

# int32 scalars of the attention kernel, in launch order (the AOT plugin builds the same list symbolically)
ATTENTION_SCALARS = (
    "kv_heads", "group", "steps", "window", "head_dim",
    "sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t", "sv_b", "sv_h", "sv_t",
    "spk_b", "spk_h", "spk_c", "spv_b", "spv_h", "spv_c",
    "spm_b", "spm_t", "stm_b", "stm_t", "so_b", "so_h", "so_t",
)
ATTENTION_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "pk_ptr", "pv_ptr", "pm_ptr", "tm_ptr")
KV_WRITE_SCALARS = ("batch", "heads", "steps", "capacity", "head_dim",
                    "sn_l", "sn_b", "sn_h", "sn_t", "sc_l", "sc_b", "sc_h", "sc_c", "ss_b")
BLOCK_M = 16
BLOCK_N = 32


def require_triton() -> None:
    if triton is None:
        raise SpecrtError("the Triton kernels need the `triton` package, which is not installed",
                          "pip install triton (Linux x86_64/aarch64; on a CPU set TRITON_INTERPRET=1 to run them)")


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim) if triton is not None else 1 << (head_dim - 1).bit_length())


if triton is not None:
    NEG = tl.constexpr(-1.0e30)  # masked score: finite, far below any real score

    @triton.jit
    def _attend_tile(q, m_i, l_i, acc, k_tile, v_tile, visible, SCALE: tl.constexpr, PRECISION: tl.constexpr):
        """One online-softmax step over a key tile (k_tile [BLOCK_D, BLOCK_N], v_tile [BLOCK_N, BLOCK_D])."""
        scores = tl.dot(q, k_tile, input_precision=PRECISION) * SCALE
        scores = tl.where(visible, scores, NEG)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(visible, tl.exp(scores - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def tree_attention_kernel(
        q_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, pm_ptr, tm_ptr,
        kv_heads, group, steps, window, head_dim,
        sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
        spk_b, spk_h, spk_c, spv_b, spv_h, spv_c,
        spm_b, spm_t, stm_b, stm_t, so_b, so_h, so_t,
        o_ptr,
        SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = pid_bh // kv_heads
        h = pid_bh % kv_heads
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # folded (g, t) rows of this K/V head
        row_ok = rows < group * steps
        t = rows % steps
        q_head = h * group + rows // steps
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q = tl.load(q_ptr + b * sq_b + q_head[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], NEG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # 1. the cache window [0, S): read in place, seen through past_mask
        for start in range(0, window, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < window
            k_tile = tl.load(pk_ptr + b * spk_b + h * spk_h + cols[None, :] * spk_c + d[:, None],
                             mask=d_ok[:, None] & col_ok[None, :], other=0.0)
            v_tile = tl.load(pv_ptr + b * spv_b + h * spv_h + cols[:, None] * spv_c + d[None, :],
                             mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            visible = tl.load(pm_ptr + b * spm_b + t[:, None] * spm_t + cols[None, :],
                              mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_tile, v_tile, visible, SCALE, PRECISION)
        # 2. the new tokens themselves, seen through tree_mask
        for start in range(0, steps, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < steps
            k_tile = tl.load(k_ptr + b * sk_b + h * sk_h + cols[None, :] * sk_t + d[:, None],
                             mask=d_ok[:, None] & col_ok[None, :], other=0.0)
            v_tile = tl.load(v_ptr + b * sv_b + h * sv_h + cols[:, None] * sv_t + d[None, :],
                             mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            visible = tl.load(tm_ptr + b * stm_b + t[:, None] * stm_t + cols[None, :],
                              mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_tile, v_tile, visible, SCALE, PRECISION)
        has = l_i > 0.0
        out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        tl.store(o_ptr + b * so_b + q_head[:, None] * so_h + t[:, None] * so_t + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def kv_write_kernel(
        nk_ptr, nv_ptr, slots_ptr, kc_in_ptr, vc_in_ptr,
        batch, heads, steps, capacity, head_dim,
        sn_l, sn_b, sn_h, sn_t, sc_l, sc_b, sc_h, sc_c, ss_b,
        kc_ptr, vc_ptr,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """cache[l, b, h, slots[b, t]] = new[l, b, h, t] for K and V; a slot < 0 or >= capacity is skipped.

        When several tokens of a row name the same slot (padding repeats a row's last slot), only the
        first writes, matching which token `split_window_mask` leaves visible. kc_in/vc_in are the
        caches as inputs; kc/vc the same buffers as outputs (a TensorRT plugin aliases them).
        """
        pid = tl.program_id(0)
        t = tl.program_id(1)
        layer = pid // (batch * heads)
        b = (pid // heads) % batch
        h = pid % heads
        slot = tl.load(slots_ptr + b * ss_b + t)
        u = tl.arange(0, BLOCK_T)
        row = tl.load(slots_ptr + b * ss_b + u, mask=u < steps, other=-1)
        earlier = tl.sum(((row == slot) & (u < t)).to(tl.int32), axis=0)
        write = ((slot >= 0) & (slot < capacity) & (earlier == 0)).to(tl.int32)
        d = tl.arange(0, BLOCK_D)
        mask = (d < head_dim) & ((d * 0 + write) != 0)  # the scalar condition broadcast over D
        src = layer * sn_l + b * sn_b + h * sn_h + t * sn_t + d
        dst = layer * sc_l + b * sc_b + h * sc_h + slot * sc_c + d
        tl.store(kc_ptr + dst, tl.load(nk_ptr + src, mask=mask, other=0.0).to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, tl.load(nv_ptr + src, mask=mask, other=0.0).to(vc_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    tree_attention_kernel = None
    kv_write_kernel = None


def precision_for(dtype: torch.dtype | str) -> str:
    """IEEE dots for float32 (TF32 would miss the reference by ~1e-3); 16-bit types use tensor cores."""
    name = str(dtype).replace("torch.", "")
    return "ieee" if name in ("float32", "fp32") else "tf32"


def _lastdim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_attention_shapes(query, key, value, past_key, past_value, past_mask, tree_mask) -> None:
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    problems = []
    if hkv == 0 or hq % hkv:
        problems.append(f"query heads {hq} are not a multiple of K/V heads {hkv}")
    if key.shape != (b, hkv, t, d) or value.shape != key.shape:
        problems.append(f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match query {tuple(query.shape)}")
    if past_key.shape[:2] != (b, hkv) or past_key.shape[3] != d or past_value.shape != past_key.shape:
        problems.append(f"past_key/past_value {tuple(past_key.shape)} do not match [B, Hkv, C, D]")
    s = past_mask.shape[-1]
    if past_mask.shape != (b, t, s) or s > past_key.shape[2]:
        problems.append(f"past_mask {tuple(past_mask.shape)} is not [B, T, S] with S <= capacity {past_key.shape[2]}")
    if tree_mask.shape != (b, t, t):
        problems.append(f"tree_mask {tuple(tree_mask.shape)} is not [B, T, T]")
    if problems:
        raise SpecrtError("TreeAttention inputs do not fit the contract: " + "; ".join(problems),
                          "pass tensors shaped as specrt.plugins.tree_attention documents")


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past_key: torch.Tensor,
                   past_value: torch.Tensor, past_mask: torch.Tensor, tree_mask: torch.Tensor,
                   scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton TreeAttention on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1)."""
    require_triton()
    _check_attention_shapes(query, key, value, past_key, past_value, past_mask, tree_mask)
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    window = past_mask.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, k, v = (_lastdim_contiguous(x) for x in (query, key, value))
    pk, pv = _lastdim_contiguous(past_key), _lastdim_contiguous(past_value)
    pm, tm = past_mask.bool().contiguous(), tree_mask.bool().contiguous()
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    scalars = (hkv, group, t, window, d,
               *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *pk.stride()[:3], *pv.stride()[:3],
               *pm.stride()[:2], *tm.stride()[:2], *out.stride()[:3])
    grid = (b * hkv, triton.cdiv(group * t, BLOCK_M))
    tree_attention_kernel[grid](q, k, v, pk, pv, pm, tm, *scalars, out,
                                SCALE=scale, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_d(d),
                                PRECISION=precision_for(query.dtype))
    return out


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
             slots: torch.Tensor) -> None:
    """In place: cache[(l,) b, :, slots[b, t]] = new[(l,) b, :, t] (caches [(L,) B, H, C, D], new [(L,) B, H, T, D]).

    The drop-in for specrt.runtime.backends.ort_models.write_new_kv on the GPU: one launch for all
    layers, K and V, instead of B index_copy calls. Negative slots are skipped (rows not kept).
    """
    require_triton()
    if k_cache.dim() == 4:
        k_cache, v_cache, new_keys, new_values = (x.unsqueeze(0) for x in (k_cache, v_cache, new_keys, new_values))
    layers, b, h, capacity, d = k_cache.shape
    t = new_keys.shape[3]
    if (new_keys.shape != (layers, b, h, t, d) or new_values.shape != new_keys.shape
            or v_cache.shape != k_cache.shape or slots.shape != (b, t)):
        raise SpecrtError(
            f"write_kv: cache {tuple(k_cache.shape)}, new rows {tuple(new_keys.shape)}, slots {tuple(slots.shape)} "
            "do not agree", "pass caches [L, B, H, C, D], new K/V [L, B, H, T, D] and slots [B, T]")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise SpecrtError("write_kv needs K and V caches with the same strides and a contiguous last dimension",
                          "allocate the caches with torch.zeros (contiguous)")
    nk, nv = new_keys.contiguous(), new_values.contiguous()  # T rows: one shared stride set for K and V
    s = slots.to(device=k_cache.device, dtype=torch.int64).contiguous()
    scalars = (b, h, t, capacity, d, *nk.stride()[:4], *k_cache.stride()[:4], s.stride(0))
    kv_write_kernel[(layers * b * h, t)](nk, nv, s, k_cache, v_cache, *scalars, k_cache, v_cache,
                                         BLOCK_T=triton.next_power_of_2(t), BLOCK_D=block_d(d))


def attention_signature(dtype: str) -> dict[str, str]:
    """The AOT signature of tree_attention_kernel for tensors of `dtype` (fp32 / fp16 / bf16)."""
    sig: dict[str, str] = {}
    for name in ATTENTION_POINTERS:
        sig[name] = "*i1" if name in ("pm_ptr", "tm_ptr") else f"*{dtype}"
    for name in ATTENTION_SCALARS:
        sig[name] = "i32"
    sig["o_ptr"] = f"*{dtype}"
    return sig


def attention_constexprs(scale: float, head_dim: int, dtype: str) -> dict[str, Any]:
    return {"SCALE": float(scale), "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_D": block_d(head_dim),
            "PRECISION": precision_for(dtype)}


__all__ = [
    "tree_attention", "write_kv", "tree_attention_kernel", "kv_write_kernel", "attention_signature",
    "attention_constexprs", "precision_for", "block_d", "require_triton", "ATTENTION_SCALARS", "ATTENTION_POINTERS",
    "KV_WRITE_SCALARS", "BLOCK_M", "BLOCK_N",
]
