"""`specrt train KIND [options]`: the trainers and the data builder behind one subcommand.

    specrt train data    ...   -> python -m specrt.tools.build_data ...
    specrt train eagle3  ...   -> python -m specrt.tools.train_eagle3 ...
    specrt train dflash  ...   -> python -m specrt.tools.train_dflash --kind dflash ...
    specrt train dspark  ...   -> python -m specrt.tools.train_dflash --kind dspark ...
    specrt train sts     ...   -> python -m specrt.tools.calibrate_sts ...
Every option after KIND goes to that tool (`specrt train dflash --help` lists them).
"""

from __future__ import annotations

import argparse
import importlib

TOOLS = {
    "data": ("specrt.tools.build_data", []),
    "eagle3": ("specrt.tools.train_eagle3", []),
    "dflash": ("specrt.tools.train_dflash", ["--kind", "dflash"]),
    "dspark": ("specrt.tools.train_dflash", ["--kind", "dspark"]),
    "sts": ("specrt.tools.calibrate_sts", []),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=sorted(TOOLS), help="what to build or train")
    p.add_argument("options", nargs=argparse.REMAINDER, help="options of that tool")


def run(args: argparse.Namespace) -> int:
    module, fixed = TOOLS[args.kind]
    return int(importlib.import_module(module).main(fixed + list(args.options)) or 0)
