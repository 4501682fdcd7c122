"""Time a drafter trainer's step in fp32 and bf16 on the real feature cache, in one run.

    python -m specrt.tools.bench_train_step --kind eagle3 [--steps 6] [--threads 1] [--precisions fp32,bf16]
    python -m specrt.tools.bench_train_step --kind dspark -- --data tools/data/sharegpt-smollm2

Every precision starts from the same weights and runs the same batches (the trainer's own
`prepare`: drafter, objective, batch plan), forward + backward + AdamW step, so the ratio of the
median step times is the speedup of `--precision bf16` on this machine, measured side by side
(run-to-run noise on a shared machine cancels in the ratio, not in the absolute times). It also
prints the first step's loss under each precision (bf16 should agree with fp32 to ~1e-2 relative)
and the loss after the timed steps. Arguments after `--` go to the trainer's parser (e.g. `--data`,
`--batch-size`); `--out` defaults to a temporary folder (nothing is written there).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import torch


def trainer_module(kind: str):
    if kind == "eagle3":
        from specrt.tools import train_eagle3

        return train_eagle3
    from specrt.tools import train_dflash

    return train_dflash


def time_steps(prep, precision: str, steps: int, lr: float) -> dict:
    """`steps` optimizer steps from a copy of the prepared drafter; seconds per step and losses."""
    from specrt.tools.train_common import autocast, make_optimizer, step_generator

    model = copy.deepcopy(prep.drafter).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, lr, 0.0)
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        with autocast(precision):
            loss, _ = prep.objective.loss(model, prep.plan(step), step_generator(0, step))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return {"precision": precision, "seconds": times, "losses": losses}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(prog="python -m specrt.tools.bench_train_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("eagle3", "dflash", "dspark"), required=True)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per precision (the first is warm-up)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    module = trainer_module(args.kind)
    with tempfile.TemporaryDirectory() as tmp:
        trainer_argv = (["--kind", args.kind] if args.kind != "eagle3" else []) + ["--out", tmp, "--no-progress"] + rest
        targs = module.parse_args(trainer_argv)
        from specrt.tools.train_common import load_target_model

        prep = module.prepare(targs, load_target_model(targs))
        results = [time_steps(prep, p.strip(), args.steps, targs.lr) for p in args.precisions.split(",")]
    base = None
    print(f"{args.kind}: {args.steps} steps per precision, batch {targs.batch_size}, {args.threads} thread(s)")
    print("| precision | median s/step | speedup | loss step 1 | loss step N |")
    print("|---|---|---|---|---|")
    for r in results:
        med = statistics.median(r["seconds"][1:] or r["seconds"])
        base = base or med
        print(f"| {r['precision']} | {med:.2f} | {base / med:.2f}x | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
