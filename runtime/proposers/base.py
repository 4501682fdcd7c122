"""The contract between the speculative loop and a drafter, whatever its kind.

A round, for every active request row b (DESIGN.md section 3):

1. `propose(rows, anchors, sampling, generator)` -> one `Proposal` per row: draft tokens in the
   tree format of `specrt.runtime.tree` (a chain is a tree whose parents are -1, 0, 1, ...), and
   for sampling the distribution each draft was drawn from (None = chosen deterministically).
   The anchor is the last emitted token, not yet in the target's cache; it sits at position
   `context_length(b)`.
2. The loop verifies [anchor, drafts...] with the target, keeps the accepted path, and calls
   `observe(b, tokens, taps, next_token)` with the tokens the target just committed (anchor +
   accepted drafts), their tap hidden states, and the token emitted after them (the new anchor).
   After prefill it calls `observe` with the whole prompt.

Seeded rows (`specrt.runtime.seeded`) are drafted with greedy `sampling`. A proposer whose class
sets `couples_noise = True` also gets `noise=`: per row a `DraftNoise` (None for other rows), and
drafts argmax(noise.scores(logits, depth)) instead of argmax(logits) for those rows, so its drafts
follow the noise verification will use (still point masses: `draft_probs` None).

A proposer owns its own cache and context length, which always mirrors the target's committed
length: what it wrote while drafting is scratch and is overwritten or masked out later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from specrt.runtime.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: torch.Tensor  # [N] int64, target vocabulary, topological order
    parents: torch.Tensor  # [N] int64, -1 = child of the anchor
    draft_probs: torch.Tensor | None = None  # [N, V] the distribution each draft was drawn from
    is_chain: bool = True
    depth: int = 0  # deepest draft position (chain: N)
    # [N] the drafter's estimate that node i and all its ancestors are accepted (None: not given);
    # non-increasing along every path. Read by the serving scheduler (specrt.runtime.serving.policy).
    survival: torch.Tensor | None = None

    @staticmethod
    def chain(tokens: torch.Tensor, draft_probs: torch.Tensor | None = None,
              survival: torch.Tensor | None = None) -> "Proposal":
        n = int(tokens.shape[0])
        return Proposal(tokens, torch.arange(-1, n - 1, dtype=torch.long), draft_probs, True, n, survival)

    def truncated(self, n: int) -> "Proposal":
        """The first n drafts (valid for trees too: parents precede children)."""
        if n >= int(self.tokens.shape[0]):
            return self
        probs = None if self.draft_probs is None else self.draft_probs[:n]
        parents = self.parents[:n]
        depth = n if self.is_chain else _depth(parents)
        survival = None if self.survival is None else self.survival[:n]
        return Proposal(self.tokens[:n], parents, probs, self.is_chain, depth, survival)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def coupled(noise) -> dict:
    """propose()'s keyword for seeded rows' couplings (module docstring): none where no row has one,
    so a proposer that does not couple noise is never handed any."""
    return {"noise": noise} if noise is not None and any(n is not None for n in noise) else {}


def _depth(parents: torch.Tensor) -> int:
    depths: list[int] = []
    for p in parents.tolist():
        depths.append(1 if p < 0 else depths[p] + 1)
    return max(depths, default=0)


class Proposer(Protocol):
    name: str
    tap_layers: tuple[int, ...]  # hidden_states indices the target must return
    max_drafts: int  # most drafts one proposal can hold (sizes the verify step)

    def reset(self, batch_size: int, capacity: int) -> None: ...

    def context_length(self, row: int) -> int: ...

    def observe(self, rows: Sequence[int], tokens: Sequence[Sequence[int]], taps: Sequence[torch.Tensor],
                next_tokens: Sequence[int]) -> None: ...

    def propose(self, rows: Sequence[int], anchors: Sequence[int], sampling: SamplingParams,
                generator: torch.Generator | None) -> list[Proposal]: ...
    # with `couples_noise = True` on the class: propose(rows, anchors, sampling, generator, noise=None)
