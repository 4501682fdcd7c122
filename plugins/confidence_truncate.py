"""`specrt::ConfidenceTruncate`: DSpark confidence logits -> survival probabilities and draft lengths.

The last node of the DSpark block graph, so the drafter engine returns, with its drafts, how many
of them are worth verifying. Three forms held to one contract: the torch reference
(`confidence_truncate_reference`, eager body of `torch.ops.specrt.confidence_truncate`), the ONNX
model-local function (`onnx_function`, standard ops only), and later a Triton kernel / TensorRT
plugin of the same name.

Contract (ONNX domain `specrt`, op `ConfidenceTruncate`, version 1; no attributes)
----------------------------------------------------------------------------------
Inputs
    conf_logits   [B, K]   T(float)  pre-sigmoid confidences z_k = w . [h_k ; W1[x_{k-1}]] + b
    temperatures  [K']     T         STS calibration temperatures, K' >= K (the first K are used)
    threshold     []       T         survival threshold (0 keeps everything the policy admits)
    sps           [M]      T         policy table: M == 1 -> threshold policy only; M > 1 -> the SPS
                                     policy with sps[n] = target steps per second when one verify
                                     step carries n tokens in total (sps[0] unused; n <= M-1)
Outputs
    survival      [B, K]   float32   a_k = prod_{i<=k} sigmoid(z_i / T_i), computed as
                                     exp(cumsum(-softplus(-z/T))) (stable for tiny survivals)
    draft_length  [B]      int64     drafts of each row to verify (a prefix of the block)

Policies
    threshold (M == 1): draft_length[b] = the longest prefix with a_{b,k} >= threshold.
    SPS (M > 1): DSpark's Algorithm 1 over the whole batch (specrt.runtime.scheduler.schedule):
        every row verifies its anchor, so the step starts at n = B tokens, tau = B expected tokens;
        candidates (b, k) with a_{b,k} > 0 and a_{b,k} >= threshold are pooled and sorted by a
        descending (ties: smaller k first, then smaller b) and admitted one at a time - n += 1,
        tau += a - while tau * sps[n] strictly improves on the last admitted value (starting from
        B * sps[B]) and n <= M - 1; the first candidate that does not improve stops the scan (the
        early stop that keeps sampling lossless). draft_length[b] = candidates admitted for b.
        Build the table from a profiled curve with `sps_vector(sps_table, max_tokens)`; a batch
        larger than M - 1 verifies no drafts.

Sampling is outside this op: the lengths depend only on the confidences, which depend on the
previous drafts, never on the draft being judged (see specrt.runtime.scheduler).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

OP_NAME = "ConfidenceTruncate"
TORCH_OP = "specrt::confidence_truncate"
INPUTS = ("conf_logits", "temperatures", "threshold", "sps")
OUTPUTS = ("survival", "draft_length")


def survival_reference(conf_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    z = conf_logits.float()
    temps = temperatures[: z.shape[-1]].float()
    return torch.exp(torch.cumsum(-F.softplus(-z / temps), dim=-1))


def confidence_truncate_reference(
    conf_logits: torch.Tensor, temperatures: torch.Tensor, threshold: torch.Tensor, sps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract above in plain torch: (survival [B, K] float32, draft_length [B] int64)."""
    survival = survival_reference(conf_logits, temperatures)
    thr = torch.as_tensor(threshold).float()
    keep = survival >= thr
    threshold_len = (torch.cumsum((~keep).long(), dim=-1) == 0).long().sum(dim=-1)
    m = sps.numel()
    if m <= 1:
        return survival, threshold_len
    b, k = survival.shape
    flat = survival.t().reshape(-1)  # index k * B + b: ties sort smaller k first, then smaller b
    valid = (flat >= thr) & (flat > 0)
    vals = torch.where(valid, flat, torch.full_like(flat, -1.0))
    ordered, index = torch.sort(vals, descending=True, stable=True)
    n = flat.numel()
    count = b + torch.arange(n) + 1
    table = sps.float()
    tau = b + torch.cumsum(ordered.clamp(min=0), dim=0)
    theta = tau * table[count.clamp(max=m - 1)]
    base = b * table[min(b, m - 1)]
    prev = torch.cat([base.reshape(1), theta[:-1]])
    ok = (theta > prev) & (ordered > -0.5) & (count <= m - 1)
    admitted = torch.cumsum((~ok).long(), dim=0) == 0
    selected = torch.zeros(n, dtype=torch.long)
    selected[index] = admitted.long()
    return survival, selected.reshape(k, b).sum(dim=0)


def sps_vector(sps: Callable[[int], float], max_tokens: int) -> torch.Tensor:
    """The `sps` input for a profiled curve: [0, sps(1), ..., sps(max_tokens)] float32."""
    return torch.tensor([0.0] + [float(sps(n)) for n in range(1, int(max_tokens) + 1)], dtype=torch.float32)


THRESHOLD_ONLY = torch.zeros(1)  # the `sps` input that selects the threshold policy


@torch.library.custom_op(TORCH_OP, mutates_args=())
def confidence_truncate(
    conf_logits: torch.Tensor, temperatures: torch.Tensor, threshold: torch.Tensor, sps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch custom op (eager body = the reference); exported as specrt::ConfidenceTruncate."""
    survival, length = confidence_truncate_reference(conf_logits, temperatures, threshold, sps)
    return survival, length


@confidence_truncate.register_fake
def _confidence_truncate_fake(conf_logits, temperatures, threshold, sps):
    survival = conf_logits.new_empty(conf_logits.shape, dtype=torch.float32)
    return survival, conf_logits.new_empty(conf_logits.shape[:1], dtype=torch.long)


# -- ONNX ------------------------------------------------------------------------------------------
def onnx_schema():
    from onnx.defs import OpSchema

    p = OpSchema.FormalParameter
    return OpSchema(
        OP_NAME,
        "specrt",
        1,
        doc=__doc__.split("\n\n")[0],
        inputs=[p(name, "T") for name in INPUTS],
        outputs=[p("survival", "F"), p("draft_length", "I")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types"),
            ("F", ["tensor(float)"], "survival"),
            ("I", ["tensor(int64)"], "lengths"),
        ],
    )


def onnx_function(opset_version: int):
    """The model-local function body (an onnxscript OnnxFunction) for a model of `opset_version`."""
    import onnxscript
    from onnxscript.values import Opset

    op = getattr(onnxscript, f"opset{opset_version}")
    specrt = Opset("specrt", 1)

    @onnxscript.script(specrt, default_opset=op)
    def ConfidenceTruncate(conf_logits, temperatures, threshold, sps):
        zero = op.Constant(value_ints=[0])
        axis0 = op.Constant(value_int=0)
        axis1 = op.Constant(value_int=1)
        z = op.Cast(conf_logits, to=1)
        steps = op.Shape(z, start=1, end=2)  # [K]
        batch = op.Shape(z, start=0, end=1)  # [B]
        temps = op.Slice(op.Cast(temperatures, to=1), zero, steps)
        log_c = op.Neg(op.Softplus(op.Neg(op.Div(z, temps))))
        survival = op.Exp(op.CumSum(log_c, axis1))
        thr = op.Cast(threshold, to=1)
        # threshold policy: the longest prefix with survival >= threshold
        dropped = op.Cast(op.Not(op.GreaterOrEqual(survival, thr)), to=7)
        kept = op.Cast(op.Equal(op.CumSum(dropped, axis1), op.Constant(value_int=0)), to=7)
        threshold_len = op.ReduceSum(kept, op.Constant(value_ints=[1]), keepdims=0)
        # SPS policy (Algorithm 1 with the early stop) over all rows' candidates
        flat = op.Reshape(op.Transpose(survival, perm=[1, 0]), op.Constant(value_ints=[-1]))
        valid = op.And(op.GreaterOrEqual(flat, thr), op.Greater(flat, op.Constant(value_float=0.0)))
        vals = op.Where(valid, flat, op.Constant(value_float=-1.0))
        count_n = op.Shape(flat)  # [N]
        ordered, index = op.TopK(vals, count_n, axis=0, largest=1, sorted=1)
        n_scalar = op.Squeeze(count_n, zero)
        b_scalar = op.Squeeze(batch, zero)
        i = op.Range(op.Constant(value_int=1), op.Add(n_scalar, op.Constant(value_int=1)), op.Constant(value_int=1))
        count = op.Add(i, b_scalar)  # verify tokens after admitting candidate i
        table = op.Cast(sps, to=1)
        last = op.Sub(op.Shape(sps), op.Constant(value_ints=[1]))  # [M-1]
        last_scalar = op.Squeeze(last, zero)
        b_float = op.Cast(batch, to=1)
        tau = op.Add(b_float, op.CumSum(op.Max(ordered, op.Constant(value_float=0.0)), axis0))
        theta = op.Mul(tau, op.Gather(table, op.Min(count, last_scalar)))
        base = op.Mul(b_float, op.Gather(table, op.Min(batch, last)))  # [1]
        prev = op.Concat(base, op.Slice(theta, zero, op.Constant(value_ints=[-1])), axis=0)
        ok = op.And(
            op.And(op.Greater(theta, prev), op.Greater(ordered, op.Constant(value_float=-0.5))),
            op.LessOrEqual(count, last_scalar),
        )
        stops = op.CumSum(op.Cast(op.Not(ok), to=7), axis0)
        admitted = op.Cast(op.Equal(stops, op.Constant(value_int=0)), to=7)
        selected = op.ScatterElements(op.Mul(op.Cast(vals, to=7), op.Constant(value_int=0)), index, admitted, axis=0)
        sps_len = op.ReduceSum(op.Reshape(selected, op.Concat(steps, batch, axis=0)), zero, keepdims=0)
        use_sps = op.Greater(last, op.Constant(value_ints=[0]))  # [1]
        draft_length = op.Where(use_sps, sps_len, threshold_len)
        return survival, draft_length

    return ConfidenceTruncate


def translation(conf_logits, temperatures, threshold, sps):
    """custom_translation_table entry: one specrt::ConfidenceTruncate node (body attached after export)."""
    from onnxscript.values import Opset

    return Opset("specrt", 1).ConfidenceTruncate(conf_logits, temperatures, threshold, sps)


__all__ = [
    "confidence_truncate", "confidence_truncate_reference", "survival_reference", "sps_vector",
    "onnx_function", "onnx_schema", "translation", "THRESHOLD_ONLY", "OP_NAME", "TORCH_OP", "INPUTS", "OUTPUTS",
]
