"""Build a proposer from a drafter checkpoint folder and a loaded target.

`--drafter NAME --drafter-ckpt PATH`: the checkpoint's kind must be NAME (config.json says which);
the drafter is refused when it does not fit the target (hidden size, vocab, taps). Without a
checkpoint the drafter shipped for the embedded default is used (`specrt.export.shipped`).
"""

from __future__ import annotations

from pathlib import Path

from specrt.plugins.errors import SpecrtError
from specrt.export.draft_options import DraftOptions
from specrt.export.models.llama import LlamaModel

DRAFTER_KINDS = ("eagle3", "dflash", "dspark")
# proposers that need no drafter checkpoint: "lookup" copies from the request's own text
FREE_KINDS = ("lookup",)


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


def measured_proposer(options: DraftOptions, drafter=None, pinned: str | None = None):
    """`--drafter auto` (pinned None): per round, whichever of plain steps, the copies alone
    (`lookup_proposer(options)`) and `drafter` (a drafter with copies grafted on; None: none) measured
    the most tokens per second; pinned "drafter" / "copies": that one (a drafter the user named),
    measured against the others in probe rounds (`specrt.runtime.proposers.auto`)."""
    from specrt.runtime.proposers.auto import AutoProposer

    return AutoProposer(lookup_proposer(options), drafter, pinned, alone_above=options.lookup_alone_above)


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
