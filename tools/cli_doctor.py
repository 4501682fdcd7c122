"""`specrt doctor` subcommand (the probes live in specrt.runtime.doctor)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from specrt.runtime.doctor import main

    return main()
