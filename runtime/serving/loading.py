"""Shared by `specrt serve`, `specrt calibrate` and the serving bench: size, calibrate, batch a loaded pipeline.

Loading the pipeline from command-line flags is the CLI's job (`specrt.tools.cli_generate.load_pipeline`).
"""

from __future__ import annotations

import argparse
import sys


def serving_pipeline(pipe):
    """The pipeline a server drives: where `--drafter auto` gave a measured proposer, its serving form
    (the drafter with copies, else the copies): the batcher's draft gate and measured gate make the
    per-step choice between drafting, copies and plain steps themselves."""
    proposer = getattr(pipe.proposer, "serving_proposer", pipe.proposer)
    return pipe if proposer is pipe.proposer else pipe.with_proposer(proposer)


def set_batch_mode(pipe, shared: bool) -> None:
    """--shared-batches: batches of an int8-activation ORT engine through the portable batched graph
    (`OrtTargetModel.per_row_batches` off) - faster at several requests, not batch-invariant."""
    if shared and getattr(pipe.model, "per_row_batches", False):
        pipe.model.per_row_batches = False


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


def make_batcher(pipe, engine, schedule: str, sps, draft_gate: bool = True, drafter: bool = True,
                 measured_gate: bool = True):
    from specrt.runtime.serving.batcher import Batcher

    proposer = serving_pipeline(pipe).proposer if drafter else None
    return Batcher(engine, proposer, schedule if proposer is not None else "fixed", sps, eos_ids(pipe),
                   draft_gate=draft_gate, measured_gate=measured_gate)
