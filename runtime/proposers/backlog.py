"""Committed tokens a drafter has not ingested yet, fed to it in one call when it next drafts.

Why. A drafter's cache mirrors the target's, so it must ingest every committed token (a forward pass
of its own: EAGLE-3's layer over the new tokens, a block drafter's context K/V), but only before it
drafts. A round that verifies the copies alone (a confident copy, a drafter expected not to pay) or
runs another arm of `--drafter auto` leaves its tokens here, and the next drafting round ingests them
all at once: one observe of k rounds' tokens equals k observes (context entries are per position),
so drafts come from the same context, and a drafter that sits out rounds costs nothing in them.

    backlog = DrafterBacklog(drafter)
    backlog.hold(rows, tokens, taps, next_tokens)    # instead of drafter.observe(...)
    backlog.catch_up()                               # before drafter.propose(...)
    seconds, rounds = backlog.last                   # what the latest catch-up cost, over how many rounds

The decode step's lazy mode (`runtime/step.py`, the serving draft gate) holds its rows' tokens in
one too, with no drafter of its own: it names the observe to feed at each catch-up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


class DrafterBacklog:
    def __init__(self, drafter=None) -> None:
        self.drafter = drafter  # whose `observe` a catch-up feeds, unless it names another
        self.rows: dict[int, tuple[list[int], list[torch.Tensor | None], list[int]]] = {}
        self.rounds = 0  # hold calls since the last catch-up
        self.last = (0.0, 0)  # (seconds, rounds held) of the latest catch-up; (0, 0) once read by `clear_last`

    def held(self, row: int) -> int:
        """Tokens of `row` waiting."""
        waiting = self.rows.get(row)
        return len(waiting[0]) if waiting else 0

    def hold(self, rows: Sequence[int], tokens: Sequence[Sequence[int]], taps: Sequence[torch.Tensor | None],
             next_tokens: Sequence[int]) -> None:
        """Keep one round's committed tokens (`Proposer.observe`'s arguments) for the next catch-up."""
        for b, toks, tap, nxt in zip(rows, tokens, taps, next_tokens):
            waiting = self.rows.get(b)
            if waiting is None:
                waiting = self.rows[b] = ([], [], [0])
            waiting[0].extend(int(t) for t in toks)
            waiting[1].append(tap)  # engines return fresh taps each forward: kept as they are
            waiting[2][0] = int(nxt)
        self.rounds += 1

    def catch_up(self, observe=None) -> None:
        """Feed everything held in one call of `observe` (default: the drafter's)."""
        if not self.rows:
            return
        observe = observe if observe is not None else self.drafter.observe
        start = time.perf_counter()
        rows = sorted(self.rows)
        waiting = [self.rows[b] for b in rows]
        taps = [None if w[1][0] is None else (w[1][0] if len(w[1]) == 1 else torch.cat(w[1])) for w in waiting]
        observe(rows, [w[0] for w in waiting], taps, [w[2][0] for w in waiting])
        self.last = (time.perf_counter() - start, max(self.rounds, 1))
        self.rows.clear()
        self.rounds = 0

    def drop(self, row: int | None = None) -> None:
        """Forget what is held (for `row`, or every row): the row starts over."""
        if row is None:
            self.rows.clear()
            self.rounds = 0
        else:
            self.rows.pop(row, None)

    def clear_last(self) -> None:
        self.last = (0.0, 0)
