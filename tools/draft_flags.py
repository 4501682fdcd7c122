"""The drafting flags of every subcommand (export, generate, serve, calibrate, bench), defined once.

Every flag defaults to None ("not given"), so the resolution in `specrt.export.draft_options` can tell
a flag the user typed from one they did not: the defaults live in `DraftOptions` alone, an engine
folder's record overrides them, and each given flag overrides only its own field.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specrt.export.draft_options import FLAG_FIELDS, DraftOptions, folder_draft_options, resolve

_D = DraftOptions()


def add_draft_arguments(group, max_drafts: bool = True) -> None:
    """--tree-top-k ... --lookup-threshold on `group` (an argparse parser or argument group)."""
    group.add_argument("--tree-top-k", type=int, default=None,
                       help=f"EAGLE-3: children per node and frontier width (default {_D.tree_top_k})")
    group.add_argument("--tree-depth", type=int, default=None,
                       help=f"EAGLE-3: deepest draft position (default {_D.tree_depth})")
    group.add_argument("--tree-tokens", type=int, default=None,
                       help=f"EAGLE-3 and block trees: verify tokens per step, anchor included (default "
                            f"{_D.tree_tokens}; sized for a CPU, GPUs want 32-64)")
    group.add_argument("--block-tree-top-k", type=int, default=None,
                       help="DSpark/DFlash: candidates per draft position, grown into a tree of --tree-tokens "
                            f"(default {_D.block_tree_top_k}: a chain)")
    group.add_argument("--confidence-threshold", type=float, default=None,
                       help="DSpark/DFlash/EAGLE-3 chains: verify drafts while their survival probability stays "
                            f"above this (default {_D.confidence_threshold})")
    if max_drafts:
        group.add_argument("--max-drafts", type=int, default=None,
                           help="DSpark/DFlash: at most this many drafts per step (default: the block)")
    group.add_argument("--lookup", type=int, default=None,
                       help="drafts copied from the request's own text per step, grafted onto the drafter's "
                            f"(default {_D.lookup}; 0: off; --drafter lookup: the chain length)")
    group.add_argument("--lookup-threshold", type=float, default=None,
                       help=f"verify a copied draft while its estimated survival stays at least this "
                            f"(default {_D.lookup_threshold})")


def draft_flags(args: argparse.Namespace) -> dict:
    """The drafting fields the user gave on the command line (absent flags: not in the dict)."""
    return {name: getattr(args, name) for name in FLAG_FIELDS if getattr(args, name, None) is not None}


def resolve_draft_options(args: argparse.Namespace, folder: str | Path | None = None) -> DraftOptions:
    """DraftOptions defaults, then the engine folder's record (if any), then each flag the user gave."""
    base = folder_draft_options(folder) if folder else DraftOptions()
    return resolve(base, draft_flags(args))
