"""The `specrt` console script: one parser, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. A `SpecrtError`
(bad input) prints its problem and fix and exits 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = {
    "generate": ("specrt.tools.cli_generate", "generate text from an engine folder (or a checkpoint), speculatively, and print its speed"),
    "export": ("specrt.tools.cli_export", "export the target and a drafter to ONNX (engines/NAME)"),
    "build": ("specrt.export.build", "build TensorRT plans (with specrt's plugins) for an engine folder"),
    "train": ("specrt.tools.cli_train", "build the training data, train drafters, calibrate DSpark"),
    "bench": ("specrt.tools.bench", "tau, acceptance per position and speed against plain decoding and peers on MT-bench"),
    "doctor": ("specrt.tools.cli_doctor", "show what this machine can run and where the default model is"),
    "inspect-drafter": ("specrt.tools.cli_inspect_drafter", "what a drafter checkpoint is: format, target fit, taps, ignored fields"),
    "serve": ("specrt.tools.cli_serve", "OpenAI-compatible HTTP server with batched speculative decoding"),
    "calibrate": ("specrt.tools.cli_calibrate", "profile SPS(B) (target steps/s vs verify tokens) on this device and calibrate the copies' hit rates"),
    "bench-serving": ("specrt.tools.bench_serving", "throughput and latency at concurrency 1..16: plain, fixed, scheduled"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specrt", description="speculative decoding runtime")
    subs = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specrt.plugins.errors import run_reporting_errors

    args = build_parser().parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return run_reporting_errors(f"specrt {args.command}", lambda: module.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
