"""Shared by `specrt serve`, `specrt calibrate` and the serving bench: load, size, calibrate, batch.

The model-loading flags are `specrt generate`'s (same names, same meaning), so one pipeline builder
(`specrt.runtime.cli_generate.build_pipeline`) serves every command.
"""

from __future__ import annotations

import argparse
import sys

from specrt.export.errors import SpecrtError


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", help="engine folder written by `specrt export` (implies --backend ort)")
    p.add_argument("--backend", default="auto", choices=["auto", "ort", "torch"],
                   help="auto: ort with --engines, torch otherwise")
    p.add_argument("--target", help="torch backend: HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu, cuda (torch device or ORT's CUDA EP) or tensorrt")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="torch backend weight dtype")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the backend's choice)")
    p.add_argument("--no-verify", action="store_true", help="ort: skip the sha256 check of the engine files")
    d = p.add_argument_group("speculative decoding")
    d.add_argument("--drafter", default="auto", choices=["auto", "none", "eagle3", "dflash", "dspark"],
                   help="auto: the engine folder's drafter (ort) / none (torch); none: plain decoding")
    d.add_argument("--drafter-ckpt", help="drafter folder (config.json + model.safetensors, official format)")
    d.add_argument("--tree-top-k", type=int, default=4, help="EAGLE-3: children per node and frontier width")
    d.add_argument("--tree-depth", type=int, default=5, help="EAGLE-3: deepest draft position")
    d.add_argument("--tree-tokens", type=int, default=16, help="EAGLE-3: verify tokens per step (anchor included)")
    d.add_argument("--confidence-threshold", type=float, default=0.1,
                   help="DSpark with --schedule fixed: verify drafts while their survival stays above this")


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slots", type=int, default=8, help="KV rows: requests decoded together (default 8)")
    p.add_argument("--capacity", type=int, default=1024, help="KV slots per row: prompt + completion (default 1024)")
    p.add_argument("--schedule", default="confidence", choices=["fixed", "confidence"],
                   help="verify lengths: fixed (as drafted) or confidence (DSpark Algorithm 1 with SPS(B))")
    p.add_argument("--sps", help="SPS table (sps.json from `specrt calibrate`; default: the engine folder's)")
    p.add_argument("--no-draft-gate", action="store_true",
                   help="confidence schedule: always draft, even when drafting has not paid recently")


def check_batch_arguments(args: argparse.Namespace) -> None:
    if args.slots < 1 or args.slots > 256:
        raise SpecrtError(f"--slots must be in 1..256, got {args.slots}", "pass --slots 8 (requests decoded together)")
    if args.capacity < 16:
        raise SpecrtError(f"--capacity {args.capacity} is too small", "pass --capacity 1024 or more")


def load_pipeline(args: argparse.Namespace):
    import torch
    from specrt.runtime.cli_generate import build_pipeline, explicit_draft_options
    from specrt.runtime.proposers.factory import DraftOptions

    DraftOptions(args.tree_top_k, args.tree_depth, args.tree_tokens, args.confidence_threshold)
    if args.threads:
        torch.set_num_threads(args.threads)
    return build_pipeline(args, explicit_draft_options(args))


def make_engine(pipe, slots: int, capacity: int):
    return pipe.engine_for(capacity, slots)


def sps_for(pipe, engine, args: argparse.Namespace, quiet: bool = False):
    """The SPS table for the confidence schedule: --sps, the engine folder's sps.json, or a quick profile."""
    from specrt.runtime.serving.calibrate import load_sps_for, profile_sps

    if pipe.proposer is None or args.schedule != "confidence":
        return None
    table = load_sps_for(getattr(args, "engines", None), getattr(args, "sps", None))
    if table is not None:
        return table
    if not quiet:
        print("no SPS table for this engine: profiling a quick one (run `specrt calibrate` to store a careful one)",
              file=sys.stderr)
    engine.set_taps(pipe.proposer.tap_layers)
    context = min(128, max(1, engine.capacity // 4))
    return profile_sps(engine, max_tokens=engine.batch_size * (pipe.proposer.max_drafts + 1), context=context,
                       repeats=2, warmup=1, meta={"quick": True})


def eos_ids(pipe) -> list[int]:
    ids = list(pipe.config.eos_token_ids or [])
    ids += [i for i in (getattr(pipe.tokenizer, "eos_token_ids", None) or []) if i not in ids]
    return ids


def make_batcher(pipe, engine, schedule: str, sps, draft_gate: bool = True, drafter: bool = True):
    from specrt.runtime.serving.batcher import Batcher

    proposer = pipe.proposer if drafter else None
    return Batcher(engine, proposer, schedule if proposer is not None else "fixed", sps, eos_ids(pipe),
                   draft_gate=draft_gate)
