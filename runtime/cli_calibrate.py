"""`specrt calibrate`: profile SPS(B) (target steps/s vs token positions per step) on this device.

    specrt calibrate --engines engines/NAME              -> engines/NAME/sps.json + sps.png
    specrt calibrate --backend torch --out runs/sps      -> runs/sps/sps.json + sps.png

The confidence schedule of `specrt serve` / the serving bench reads it (see
`specrt.runtime.serving.calibrate` for what is measured). It is specific to the device, backend,
thread count and slot count: re-run it when they change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specrt.runtime.cli_serve import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--slots", type=int, default=8, help="KV rows, as `specrt serve --slots` (default 8)")
    p.add_argument("--context", type=int, default=128, help="tokens already in each row while timing (default 128)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="largest B to profile (default: slots x (the drafter's verify size), or slots x 16)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (median; default 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", help="folder for sps.json + sps.png (default: the engine folder; torch: runs/sps/NAME)")


def run(args: argparse.Namespace) -> int:
    from specrt.export.errors import SpecrtError
    from specrt.runtime.cli_generate import resolve_backend
    from specrt.runtime.serving.calibrate import SPS_FILE, plot_sps, profile_sps
    from specrt.runtime.serving.loading import load_pipeline

    backend = resolve_backend(args)
    if args.slots < 1 or args.context < 1 or args.repeats < 1 or args.warmup < 0:
        raise SpecrtError("--slots, --context and --repeats must be >= 1 (--warmup >= 0)",
                          "e.g. --slots 8 --context 128 --repeats 5")
    pipe = load_pipeline(args)
    verify = pipe.proposer.max_drafts + 1 if pipe.proposer is not None else 16
    max_tokens = args.max_tokens or args.slots * verify
    engine = pipe.engine_for(args.context + max_tokens // args.slots + 1, args.slots)
    engine.set_taps(pipe.proposer.tap_layers if pipe.proposer is not None else ())
    out = Path(args.out) if args.out else (Path(args.engines) if args.engines else Path("runs/sps") / pipe.name)
    out.mkdir(parents=True, exist_ok=True)
    print(f"profiling {pipe.name} ({backend}, {args.device}) with {args.slots} slots at context {args.context}",
          file=sys.stderr)

    def progress(b, rows, t, sps):
        print(f"  B={b:4d} ({rows} rows x {t} tokens): {sps:8.2f} steps/s  {1000.0 / sps:7.2f} ms/step", file=sys.stderr)

    table = profile_sps(engine, max_tokens, args.context, args.repeats, args.warmup, progress=progress,
                        meta={"engine": pipe.name, "backend": backend, "device": args.device,
                              "drafter": pipe.proposer.name if pipe.proposer is not None else "none"})
    table.save(out / SPS_FILE)
    try:
        plot_sps(table, out / "sps.png")
        print(f"wrote {out / SPS_FILE} and {out / 'sps.png'}", file=sys.stderr)
    except ImportError:
        print(f"wrote {out / SPS_FILE} (no plot: pip install matplotlib)", file=sys.stderr)
    return 0
