"""Build a proposer from a drafter checkpoint folder and a loaded target.

`--drafter NAME --drafter-ckpt PATH`: the checkpoint's kind must be NAME (config.json says which);
the drafter is refused when it does not fit the target (hidden size, vocab, taps). Without a
checkpoint the drafter shipped for the embedded default is used (`specrt.export.shipped`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specrt.plugins.errors import SpecrtError
from specrt.export.models.llama import LlamaModel
from specrt.runtime.proposers.lookup import (
    DEFAULT_ALONE_ABOVE,
    DEFAULT_LOOKUP_THRESHOLD,
    DEFAULT_LOOKUP_TOKENS,
    DEFAULT_MAX_MATCH,
    DEFAULT_MIN_MATCH,
    check_lookup_settings,
)

DRAFTER_KINDS = ("eagle3", "dflash", "dspark")
# proposers that need no drafter checkpoint: "lookup" copies from the request's own text
FREE_KINDS = ("lookup",)


@dataclass
class DraftOptions:
    tree_top_k: int = 4
    tree_depth: int = 5
    tree_tokens: int = 16  # verify tokens per step for EAGLE-3, anchor included
    # DSpark / DFlash / EAGLE-3 chains: keep drafts while the survival stays above this
    confidence_threshold: float = 0.1
    max_drafts: int | None = None  # DSpark / DFlash: at most this many drafts per step (None: the block)
    # DSpark / DFlash: candidates per tree node (1 = a chain); a tree has tree_tokens - 1 nodes at most
    block_tree_top_k: int = 1
    # drafts copied from the request's own text and grafted onto the drafter's (0: off); see
    # specrt.runtime.proposers.lookup. Also the chain length of the drafter-free "lookup" kind.
    lookup: int = 0
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

    def lookup_manifest(self) -> dict:
        """The lookup defaults an engine folder records (`drafter.lookup` in manifest.json)."""
        return {"max_tokens": self.lookup, "threshold": self.lookup_threshold, "min_match": self.lookup_min_match,
                "max_match": self.lookup_max_match, "alone_above": self.lookup_alone_above}


def load_proposer(
    kind: str,
    checkpoint: str | Path | None,
    target: LlamaModel,
    options: DraftOptions | None = None,
    target_name: str | None = None,
):
    """A proposer for `kind` from `checkpoint`, or from the drafter shipped for `target_name`."""
    from specrt.export.checkpoints.drafters import load_drafter
    from specrt.export.shipped import shipped_drafter

    options = options or DraftOptions()
    if kind in FREE_KINDS:
        return lookup_proposer(options)
    if kind not in DRAFTER_KINDS:
        raise SpecrtError(f"unknown drafter {kind!r}",
                          f"use one of {', '.join(DRAFTER_KINDS + FREE_KINDS)} (or none)")
    if checkpoint is None and target_name is not None:
        checkpoint = shipped_drafter(kind, target_name)
    if checkpoint is None:
        raise SpecrtError(
            f"no {kind} drafter checkpoint was given and none ships for target {target_name or '(custom)'}",
            f"pass --drafter-ckpt PATH (a folder with config.json + model.safetensors of a {kind} drafter), "
            f"or train one: specrt train {kind} --out runs/{kind}",
        )
    dtype = target.embed_tokens.weight.dtype
    drafter = load_drafter(checkpoint, target.config, kind=kind, dtype=dtype).to(target.embed_tokens.weight.device)
    if kind == "eagle3":
        if drafter.embed_tokens is None:
            drafter.bind_target_embedding(target.embed_tokens)
    else:
        drafter.bind_target(target.embed_tokens, target.lm_head)
    return proposer_for(kind, drafter, options)


def proposer_for(kind: str, drafter, options: DraftOptions | None = None, chain_only: bool = False):
    """The proposer of `kind` around a ready drafter (a torch module or its ORT twin), with the
    lookup copies grafted on when options.lookup > 0 (chain_only: see `with_lookup`)."""
    from specrt.runtime.proposers.block import BlockProposer
    from specrt.runtime.proposers.eagle3 import Eagle3Proposer

    options = options or DraftOptions()
    if kind in FREE_KINDS:
        return lookup_proposer(options)
    if kind == "eagle3":
        # the threshold only cuts chains (top_k 1); trees rank their nodes by path probability instead
        proposer = Eagle3Proposer(drafter, options.tree_top_k, options.tree_depth, options.tree_tokens,
                                  threshold=options.confidence_threshold)
    else:
        proposer = BlockProposer(drafter, threshold=options.confidence_threshold, max_drafts=options.max_drafts,
                                 tree_top_k=options.block_tree_top_k, tree_tokens=options.tree_tokens)
    return with_lookup(proposer, options, chain_only)


def lookup_proposer(options: DraftOptions):
    """The drafter-free proposer: drafts copied from the request's own text."""
    from specrt.runtime.proposers.lookup import LookupProposer

    return LookupProposer(tree=options.lookup_tree, **options.lookup_settings())


def with_lookup(proposer, options: DraftOptions, chain_only: bool = False):
    """`proposer`, with the lookup chain grafted on when options.lookup > 0.

    chain_only: engines that verify chains only get one chain per step (the lookup copy or the
    drafter's, whichever expects more accepted tokens), not a tree of both."""
    if options.lookup <= 0 or proposer is None or proposer.name == "lookup":
        return proposer
    from specrt.runtime.proposers.lookup import WithLookup

    return WithLookup(proposer, chain_only=chain_only, alone_above=options.lookup_alone_above,
                      **options.lookup_settings())
