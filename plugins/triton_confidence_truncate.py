"""Triton kernel for `specrt::ConfidenceTruncate` (DSpark): survival probabilities and draft lengths.

    survival, draft_length = confidence_truncate(conf_logits, temperatures, threshold, sps)

Holds to the contract of specrt.plugins.confidence_truncate (threshold policy when sps has one
entry, DSpark's Algorithm 1 over the whole batch otherwise); tests/test_triton_kernels.py compares it
with the torch reference on random batches.

Design
------
The op is tiny (B * K candidates, a few hundred at most) but its SPS policy is a global decision:
candidates of all rows are ranked by survival and admitted in that order while the expected
throughput improves. A sort has no cheap form in one Triton program, so the kernel works on ranks:
one program holds all N = B * K candidates (flat index f = k * B + b, the reference's tie order)
and computes, from [N, N] pairwise comparisons,
  * each candidate's rank (how many candidates sort before it: larger survival, or equal survival
    and smaller f),
  * tau at each candidate (B + the survivals of all candidates up to and including it),
  * the candidate ranked just before it (for the "strictly improves" test),
  * whether every candidate up to it passed (the early stop),
and the per-row cumulative survival the same way. Everything is O(N^2) on-chip work with no memory
traffic beyond the inputs; N is capped (MAX_CANDIDATES) so the pairwise tiles stay in registers.
Sums run in a different order than the reference's cumsum, so a survival within float rounding of
the threshold, or a throughput tie within rounding, may decide differently; otherwise the outputs
are identical.

Argument order for TensorRT's AOT launch: the four input pointers, int32 scalars, the two output
pointers (specrt.plugins.triton_aot).
"""

from __future__ import annotations

from typing import Any

import torch
from specrt.plugins.errors import SpecrtError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

MAX_CANDIDATES = 1024  # B * K; the TensorRT plugin compiles one block size (AOT_BLOCK) and the build checks it
AOT_BLOCK = 256
SCALARS = ("batch", "steps", "table_len", "sc_b")

if triton is not None:

    @triton.jit
    def confidence_truncate_kernel(
        conf_ptr, temps_ptr, thr_ptr, sps_ptr,
        batch, steps, table_len, sc_b,
        surv_ptr, len_ptr,
        BLOCK_N: tl.constexpr,
    ):
        n = batch * steps
        i = tl.arange(0, BLOCK_N)
        lane = i < n
        kk = i // batch
        bb = i % batch
        z = tl.load(conf_ptr + bb * sc_b + kk, mask=lane, other=0.0).to(tl.float32)
        temp = tl.load(temps_ptr + kk, mask=lane, other=1.0).to(tl.float32)
        x = -z / temp
        log_c = tl.where(lane, -(tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))), 0.0)
        # survival: cumulative sum of log-confidences along k inside each row
        row_upto = (bb[None, :] == bb[:, None]) & (kk[None, :] <= kk[:, None]) & lane[None, :]
        survival = tl.exp(tl.sum(tl.where(row_upto, log_c[None, :], 0.0), axis=1))
        tl.store(surv_ptr + bb * steps + kk, survival, mask=lane)
        thr = tl.load(thr_ptr).to(tl.float32)
        # threshold policy: the first k of each row whose survival drops below the threshold
        fail_k = tl.where(lane & (survival < thr), kk, steps)
        # SPS policy: ranks from pairwise comparisons (j sorts before i)
        valid = lane & (survival >= thr) & (survival > 0.0)
        val = tl.where(valid, survival, tl.where(lane, -1.0, -2.0))
        before = (val[None, :] > val[:, None]) | ((val[None, :] == val[:, None]) & (i[None, :] < i[:, None]))
        upto = before | (i[None, :] == i[:, None])
        rank = tl.sum(before.to(tl.int32), axis=1)
        tau = batch + tl.sum(tl.where(upto, tl.maximum(val, 0.0)[None, :], 0.0), axis=1)
        count = batch + rank + 1
        last = table_len - 1
        theta = tau * tl.load(sps_ptr + tl.minimum(count, last)).to(tl.float32)
        base = batch * tl.load(sps_ptr + tl.minimum(batch, last)).to(tl.float32)
        previous = tl.sum(tl.where(rank[None, :] == rank[:, None] - 1, theta[None, :], 0.0), axis=1)
        previous = tl.where(rank == 0, base, previous)
        ok = (theta > previous) & (val > -0.5) & (count <= last)
        stops = tl.sum(tl.where(upto & (ok == 0)[None, :], 1, 0), axis=1)
        admitted = lane & (stops == 0)
        for b in range(batch):
            mine = lane & (bb == b)
            sps_len = tl.sum(tl.where(mine & admitted, 1, 0), axis=0)
            threshold_len = tl.min(tl.where(mine, fail_k, steps), axis=0)
            length = tl.where(table_len > 1, sps_len, threshold_len)
            tl.store(len_ptr + b, length.to(tl.int64))

else:  # pragma: no cover
    confidence_truncate_kernel = None


def block_for(candidates: int) -> int:
    if candidates > MAX_CANDIDATES:
        raise SpecrtError(f"ConfidenceTruncate: {candidates} candidates (batch x block) exceed the kernel's "
                          f"{MAX_CANDIDATES}", "use a smaller batch or block size")
    return max(16, triton.next_power_of_2(max(candidates, 1)))


def confidence_truncate(conf_logits: torch.Tensor, temperatures: torch.Tensor, threshold: torch.Tensor,
                        sps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton ConfidenceTruncate on torch tensors: (survival [B, K] float32, draft_length [B] int64)."""
    if triton is None:
        raise SpecrtError("the Triton kernels need the `triton` package, which is not installed", "pip install triton")
    b, k = conf_logits.shape
    if temperatures.dim() != 1 or temperatures.shape[0] < k or sps.dim() != 1 or sps.numel() < 1:
        raise SpecrtError(f"ConfidenceTruncate: temperatures {tuple(temperatures.shape)} / sps {tuple(sps.shape)} "
                          f"do not fit conf_logits [{b}, {k}]", "pass temperatures [K' >= K] and sps [M >= 1]")
    conf = conf_logits if conf_logits.stride(-1) == 1 else conf_logits.contiguous()
    survival = torch.empty((b, k), dtype=torch.float32, device=conf.device)
    length = torch.empty((b,), dtype=torch.int64, device=conf.device)
    thr = torch.as_tensor(threshold, device=conf.device).reshape(1)
    confidence_truncate_kernel[(1,)](conf, temperatures.contiguous(), thr, sps.contiguous(),
                                     b, k, sps.numel(), conf.stride(0), survival, length,
                                     BLOCK_N=block_for(b * k), num_warps=8)
    return survival, length


def signature(dtype: str) -> dict[str, str]:
    """AOT signature for inputs of `dtype` (fp32 / fp16 / bf16)."""
    sig = {name: f"*{dtype}" for name in ("conf_ptr", "temps_ptr", "thr_ptr", "sps_ptr")}
    sig.update({name: "i32" for name in SCALARS})
    sig.update({"surv_ptr": "*fp32", "len_ptr": "*i64"})
    return sig


def constexprs() -> dict[str, Any]:
    return {"BLOCK_N": AOT_BLOCK}


__all__ = ["confidence_truncate", "confidence_truncate_kernel", "signature", "constexprs", "block_for",
           "MAX_CANDIDATES", "AOT_BLOCK", "SCALARS"]
