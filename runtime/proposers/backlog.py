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

A request's prompt may wait here too (`hold(..., prompt=True)`: `--drafter auto` and named drafters
under it, `auto.py`): a request whose drafter never drafts (sampled text it does not pay on) then
never pays for ingesting its prompt, and its first token is not held up by it. A catch-up ingests a
held prompt in a call of its own, timed apart (`prompt_seconds`), so `last` stays the cost of the
rounds' tokens that sizing and the arms' rates charge to drafting.

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
        self.prompts: dict[int, tuple[list[int], torch.Tensor | None, int]] = {}  # row -> its held prompt
        self.prompt_seconds = 0.0  # what ingesting held prompts cost, since `clear_last` (not part of `last`)
        self.rounds = 0  # hold calls since the last catch-up
        self.last = (0.0, 0)  # (seconds, rounds held) of the latest catch-up; (0, 0) once read by `clear_last`

    def held(self, row: int) -> int:
        """Tokens of `row` waiting."""
        waiting, prompt = self.rows.get(row), self.prompts.get(row)
        return (len(waiting[0]) if waiting else 0) + (len(prompt[0]) if prompt else 0)

    def hold(self, rows: Sequence[int], tokens: Sequence[Sequence[int]], taps: Sequence[torch.Tensor | None],
             next_tokens: Sequence[int], prompt: bool = False) -> None:
        """Keep one round's committed tokens (`Proposer.observe`'s arguments) for the next catch-up;
        prompt: the rows' prompts, at prefill (not a round: module docstring)."""
        if prompt:
            for b, toks, tap, nxt in zip(rows, tokens, taps, next_tokens):
                if b in self.prompts or b in self.rows:
                    raise ValueError(f"row {b} already holds tokens: a prompt comes first")
                self.prompts[b] = ([int(t) for t in toks], tap, int(nxt))
            return
        for b, toks, tap, nxt in zip(rows, tokens, taps, next_tokens):
            waiting = self.rows.get(b)
            if waiting is None:
                waiting = self.rows[b] = ([], [], [0])
            waiting[0].extend(int(t) for t in toks)
            waiting[1].append(tap)  # engines return fresh taps each forward: kept as they are
            waiting[2][0] = int(nxt)
        self.rounds += 1

    def catch_up(self, observe=None) -> None:
        """Feed everything held to `observe` (default: the drafter's): held prompts in one call, then
        the rounds' tokens in one call."""
        observe = observe if observe is not None else self.drafter.observe
        if self.prompts:
            start = time.perf_counter()
            rows = sorted(self.prompts)
            held = [self.prompts[b] for b in rows]
            observe(rows, [h[0] for h in held], [h[1] for h in held], [h[2] for h in held])
            self.prompts.clear()
            self.prompt_seconds += time.perf_counter() - start
        if not self.rows:
            return
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
            self.prompts.clear()
            self.rounds = 0
        else:
            self.rows.pop(row, None)
            self.prompts.pop(row, None)

    def clear_last(self) -> None:
        self.last = (0.0, 0)
        self.prompt_seconds = 0.0
