"""How a proposer drafts: the one definition of every drafting default, and how they are resolved.

`DraftOptions` is part of the contract between an engine folder and the runtime: `specrt export`
records the folder's drafting defaults in manifest.json (`drafting`: tree, policy, lookup), and the runtime starts from them. The defaults below are sized for a CPU, where
every verified token costs a target row (a 2/2/4 EAGLE-3 tree; GPUs want wider trees: pass
`--tree-top-k 8 --tree-depth 6 --tree-tokens 48` or export with them).

Resolution, field by field (`resolve`):
    DraftOptions() defaults  ->  the engine folder's record (`from_manifest`)  ->  each flag the user gave
A flag the user did not give is None and changes nothing, so `--lookup 8` on a folder keeps the
folder's tree shape. None of this changes what is output: drafts are always verified by the target.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrt.plugins.errors import SpecrtError

DEFAULT_LOOKUP_TOKENS = 16  # copies from the request's text per step (0: off)
DEFAULT_MIN_MATCH = 1
DEFAULT_MAX_MATCH = 8
DEFAULT_LOOKUP_THRESHOLD = 0.15  # verify a copied token while its estimated survival is at least this
DEFAULT_ALONE_ABOVE = 0.8  # a copy whose first token is this likely right is verified without the drafter's

# the fields a command-line flag sets (flag --tree-top-k -> field tree_top_k, and so on)
FLAG_FIELDS = ("tree_top_k", "tree_depth", "tree_tokens", "confidence_threshold", "max_drafts",
               "block_tree_top_k", "lookup", "lookup_threshold")


def check_lookup_settings(max_tokens: int, min_match: int, max_match: int, threshold: float) -> None:
    if max_tokens < 1:
        raise SpecrtError(f"lookup drafts per step must be >= 1, got {max_tokens}",
                          "pass --lookup N with N >= 1 (0 turns lookup off)")
    if not 1 <= min_match <= max_match:
        raise SpecrtError(f"bad lookup match lengths: min {min_match}, max {max_match}",
                          "use 1 <= --lookup-min-match <= --lookup-max-match")
    if not 0.0 <= threshold <= 1.0:
        raise SpecrtError(f"lookup threshold {threshold} is outside [0, 1]",
                          "pass --lookup-threshold between 0 (verify every copied token) and 1")


@dataclass
class DraftOptions:
    tree_top_k: int = 2  # EAGLE-3: children per node and frontier width
    tree_depth: int = 2  # EAGLE-3: deepest draft position
    tree_tokens: int = 4  # verify tokens per step for EAGLE-3 and block trees, anchor included
    # DSpark / DFlash / EAGLE-3 chains: keep drafts while their survival probability stays above this
    confidence_threshold: float = 0.0
    max_drafts: int | None = None  # DSpark / DFlash: at most this many drafts per step (None: the block)
    # DSpark / DFlash: candidates per tree node (1 = a chain); a tree has tree_tokens - 1 nodes at most
    block_tree_top_k: int = 1
    # drafts copied from the request's own text and grafted onto the drafter's (0: off); see
    # specrt.runtime.proposers.lookup. Also the chain length of the drafter-free "lookup" kind.
    lookup: int = DEFAULT_LOOKUP_TOKENS
    lookup_threshold: float = DEFAULT_LOOKUP_THRESHOLD
    lookup_min_match: int = DEFAULT_MIN_MATCH
    lookup_max_match: int = DEFAULT_MAX_MATCH
    lookup_alone_above: float = DEFAULT_ALONE_ABOVE  # a copy this sure of its first token skips the drafter
    # calibrated copy hit rates (specrt.runtime.proposers.lookup_prior; an engine folder's lookup.json)
    lookup_prior: object = field(default=None, compare=False, repr=False)
    # copies from a store of the target's earlier text (specrt.runtime.proposers.datastore; datastore.npz)
    lookup_datastore: object = field(default=None, compare=False, repr=False)
    # a one-token copy is free (the engine decodes one token as two rows anyway): verify one whatever its odds
    lookup_free_first: bool = field(default=False, compare=False)
    # the drafter-free lookup may verify two disagreeing copies as two branches (engines exact on trees)
    lookup_tree: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.tree_top_k < 1 or self.tree_depth < 1 or self.tree_tokens < 2:
            raise SpecrtError(
                f"bad tree settings top_k={self.tree_top_k} depth={self.tree_depth} tokens={self.tree_tokens}",
                "use --tree-top-k >= 1, --tree-depth >= 1 and --tree-tokens >= 2",
            )
        if self.block_tree_top_k < 1:
            raise SpecrtError(f"--block-tree-top-k must be >= 1, got {self.block_tree_top_k}",
                              "use 1 for a chain of drafts, or more candidates per position for a tree")
        if self.max_drafts is not None and self.max_drafts < 1:
            raise SpecrtError(f"--max-drafts must be >= 1, got {self.max_drafts}", "pass a positive draft count")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise SpecrtError(
                f"confidence threshold {self.confidence_threshold} is outside [0, 1]",
                "pass --confidence-threshold between 0 (verify every draft) and 1",
            )
        if self.lookup < 0:
            raise SpecrtError(f"--lookup must be >= 0, got {self.lookup}", "pass 0 (off) or the copied drafts per step")
        check_lookup_settings(max(self.lookup, 1), self.lookup_min_match, self.lookup_max_match,
                              self.lookup_threshold)

    def lookup_settings(self) -> dict:
        return {"max_tokens": self.lookup or DEFAULT_LOOKUP_TOKENS, "min_match": self.lookup_min_match,
                "max_match": self.lookup_max_match, "threshold": self.lookup_threshold, "prior": self.lookup_prior,
                "datastore": self.lookup_datastore, "free_first": self.lookup_free_first}

    def manifest_record(self) -> dict:
        """The drafting defaults an engine folder records (the `drafting` section of manifest.json)."""
        return {
            "tree": {"top_k": self.tree_top_k, "depth": self.tree_depth, "total_tokens": self.tree_tokens},
            "policy": {"threshold": self.confidence_threshold, "max_drafts": self.max_drafts,
                       "block_tree_top_k": self.block_tree_top_k},
            "lookup": {"max_tokens": self.lookup, "threshold": self.lookup_threshold,
                       "min_match": self.lookup_min_match, "max_match": self.lookup_max_match,
                       "alone_above": self.lookup_alone_above},
        }


def resolve(base: DraftOptions, given: Mapping[str, Any]) -> DraftOptions:
    """`base` with each field the user gave (not None) replaced; unknown names are a bug, not input."""
    unknown = set(given) - {f.name for f in dataclasses.fields(DraftOptions)}
    if unknown:
        raise TypeError(f"not DraftOptions fields: {sorted(unknown)}")
    changes = {name: value for name, value in given.items() if value is not None}
    return dataclasses.replace(base, **changes) if changes else base


def from_manifest(manifest: Mapping[str, Any]) -> DraftOptions:
    """DraftOptions from a manifest's `drafting` section (folders written before it existed: the same
    keys in their `drafter` section): each recorded field over the defaults."""
    section = manifest.get("drafting") or manifest.get("drafter") or {}
    tree = section.get("tree") or {}
    policy = section.get("policy") or {}
    lookup = section.get("lookup") or {}
    recorded = {
        "tree_top_k": tree.get("top_k"), "tree_depth": tree.get("depth"), "tree_tokens": tree.get("total_tokens"),
        "confidence_threshold": policy.get("threshold"), "max_drafts": policy.get("max_drafts"),
        "block_tree_top_k": policy.get("block_tree_top_k"),
        "lookup": lookup.get("max_tokens"), "lookup_threshold": lookup.get("threshold"),
        "lookup_min_match": lookup.get("min_match"), "lookup_max_match": lookup.get("max_match"),
        "lookup_alone_above": lookup.get("alone_above"),
    }
    return resolve(DraftOptions(), recorded)


def folder_draft_options(folder: str | Path) -> DraftOptions:
    """The drafting defaults an engine folder records (the defaults when it records none or is unreadable:
    loading the folder reports what is wrong with it)."""
    try:
        data = json.loads((Path(folder) / "manifest.json").read_text())
    except (OSError, ValueError):
        return DraftOptions()
    return from_manifest(data if isinstance(data, dict) else {})
