"""Proposers: what a drafter contributes to the speculative loop (see `base.Proposer`)."""

from specrt.runtime.proposers.base import Proposal, Proposer

__all__ = ["Proposal", "Proposer"]
