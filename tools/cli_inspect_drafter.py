"""`specrt inspect-drafter PATH`: the detected format of a drafter checkpoint, whether it fits the target,
its taps, draft vocabulary and block, and every config field or tensor it ignores and why.

The inspection itself is `specrt.export.checkpoints.drafter_inspect`; this module only prints it.
Exit status: 0 fits the target, 1 does not fit, 2 refused (a SpecrtError names the problem and fix).
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="drafter folder: config.json + model.safetensors (EAGLE-3, DFlash or DSpark)")
    p.add_argument("--target", default=None,
                   help="HF folder or .gguf the drafter is for (default: the embedded SmolLM2-135M); "
                        "only its config is read")
    p.add_argument("--kind", default=None, choices=("eagle3", "dflash", "dspark"),
                   help="insist on this drafter kind (default: what the checkpoint says)")


def run(args: argparse.Namespace) -> int:
    from specrt.export.checkpoints.drafter_inspect import inspect_drafter

    report = inspect_drafter(args.path, args.target, args.kind)
    print("\n".join(report.lines()))
    return 0 if report.fits else 1
