"""How many drafts a drafter round verifies: the chain length or tree size with the most expected
tokens per second on this engine, from measured costs and calibrated survival estimates.

Why. On a CPU every verified row costs. int4 SmolLM2-135M on 2 threads: a verify forward of T tokens costs 6.7 ms at T=1, 7.4 at 2, 12.5 at 4, 17.4 at
8, 29.8 at 16, so past the second row each row costs ~1.5 ms and verifying a 15-draft block costs
4.5 plain steps while ~2 of its drafts land. A drafter's chain or block verified whole (confidence
threshold 0 by default) pays for rows that do not pay back.

The rule (DSpark's Algorithm 1 for one request). With the step cost line cost(T) = c0 + c1 T
(`step_cost.StepCost`, fitted to the loop's own verify steps), the drafter's own cost d per round
(the measured time of its `propose`, a decayed mean) and survival estimates s_i = P(draft i and all
its ancestors are accepted), a round verifying the drafts in a set S emits 1 + sum_S s_i tokens in
expectation and costs d + cost(1 + |S|). Chains: the prefix length L maximising that ratio
(`step_cost.best_length`). Trees: nodes are taken in order of highest survival among the children
of nodes already taken (`tree_order`: a subtree closed under parents at every size; survival never
grows along a path, so it is also the best subtree of its size), and the size is chosen by the same
ratio. d is spent before the cut, but it still belongs to the round's cost: the larger it is, the
more rows a round may verify before an extra row lowers its tokens per second.

Where survival comes from (`DraftRecord`). Copies: the lookup's `HitRecord` (per match length and
depth, calibrated by lookup.json). Drafters: their own confidence, calibrated online. Each draft's
conditional confidence q_i = s_i / s_parent is read off `Proposal.survival` (DSpark: its confidence
head; DFlash: the top probability of each block position; EAGLE-3: the path probability), and per
(depth group, confidence bin) the record keeps decayed sums of hits (the draft matched what the
target emitted, given its parent did) and of q over the same trials; the calibrated conditional
rate is q * (hits + w) / (sum q + w). Without data it is q itself (the drafter's own claim); with
data it is the cell's measured rate, still ranking drafts within a cell by their own confidence.
Why not the raw confidence: the drafters are trained against another target or another weight
format (int4 rounding), and a confidence head calibrated offline drifts; why not per-depth rates
alone: they give every step the same length, while the confidence tells a step that will land from
one that will not. Measured on the int4 SmolLM2-135M folders (4 MT-bench and 4 HumanEval prompts x
128 greedy tokens, twice; Brier score of each scored draft's prediction made before it was scored,
lower is better): EAGLE-3 raw .172 / per depth .207 / calibrated .169; DFlash .125 / .131 / .119;
DSpark .193 / .229 / .197 (its head is calibrated offline: a draw). A proposal without survival estimates gets q = .5:
its rates are then the per-depth acceptance rates.

Skipping the drafter. Before drafting, the round a drafter is expected to give (decayed means of
its past rounds' expected tokens and verified rows, at today's cost and d) is compared with what
this step gets without it: the copies alone at their best length, or a plain step. When the
drafter is expected to be slower, the round verifies the copies alone (no drafter forward, as a
confident copy already does). The drafter is asked anyway after `REASK` such rounds, so its
estimates follow the text, and after twice as many each time it still does not pay (at most
`MAX_REASK`): where it never pays (sampled text its drafts rarely match) its forward, and its
catch-up on the rounds it sat out, cost a few percent of a round, not an eighth. `--drafter auto`
measures its arms itself: a drafter arm that skips its drafter costs what the copies arm does.

Idle rounds (`IdleRounds`). Sizing a round has its own cost: the lookups, the estimates, the
drafter's re-asks and catch-ups, ~0.2 ms of a ~5 ms round on the int4 default; and a round that
verifies drafts pays their rows whether they land or not. Where nothing pays (text sampled at
temperature 1, which neither the copies nor the shipped drafters predict: ~0.03-0.1 accepted drafts
a round, while the survival estimates, calibrated on greedy text, still verify a copy now and then)
that is a few percent slower than plain decoding for nothing. So the round is skipped whole, as a
plain step, when the drafts accepted per sized round (decayed means, after `MIN_SIZED` sized rounds
of the request) are worth less than what a sized round costs beyond a plain step: accepted drafts x a
plain step's seconds < sizing seconds + (the round's verify seconds - a plain step's), which is
exactly where its tokens per second fall below plain decoding's. The gap of idle rounds doubles from
2 to `MAX_IDLE` (greedy) or `MAX_IDLE_SAMPLED` (sampled) while that holds and resets once it does
not. Greedy text that copies pay on accepts ~1-3 drafts a round and is never idle.

What the idle rule learned carries over to the next request with the same sampling settings
(`IdleRounds.begin`, keyed by temperature, top-k and top-p: a request at temperature 1 after
one at temperature 1), so a request does not spend its first `MIN_SIZED` rounds re-learning that
nothing pays; a request with other settings (greedy after sampled) starts from its own state or
afresh. Measured on the int4 EAGLE-3 folder, named, 4 MT-bench prompts x 256 tokens at temperature
1: after the first request, 10 rounds in 1000 verified drafts and 10 ran the drafter (gaps of up to
32, carried), against 77 rounds that verified drafts with gaps of at most 8, as greedy requests keep.

Lossless. Every choice here reads the committed history, past records, past step times and the
drafter's own output, never this step's target output, and the target verifies whatever is left:
greedy output is the target's. Timing-dependent cuts are made only for greedy drafting (the
caller's rule, as for the copies): a sampled request's drafts must not depend on the clock.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from typing import Sequence

import torch

from specrt.runtime.proposers.base import Proposal, _depth
from specrt.runtime.proposers.step_cost import best_length, timed_mean

DEPTH_GROUPS = 4  # depths 1, 2, 3 and 4+ are calibrated apart
CONFIDENCE_EDGES = (0.3, 0.7)  # the drafter's conditional confidence: low, middle, high
MAX_RATE = 0.999  # a calibrated conditional rate stays below 1: survival strictly falls along a path
UNKNOWN_CONFIDENCE = 0.5  # a proposal without survival estimates: its record is per depth only
REASK = 8  # a drafter expected to be slower is still asked after REASK rounds (module docstring)
MAX_REASK = 64


class DraftRecord:
    """A drafter's confidence against what the target accepted (module docstring: the calibration)."""

    def __init__(self, weight: float = 4.0, decay: float = 0.98) -> None:
        self.weight, self.decay = float(weight), float(decay)
        self.hits: dict[tuple[int, int], float] = {}
        self.expected: dict[tuple[int, int], float] = {}

    @staticmethod
    def cell(depth: int, q: float) -> tuple[int, int]:
        return min(depth, DEPTH_GROUPS), bisect_right(CONFIDENCE_EDGES, q)

    def rate(self, depth: int, q: float) -> float:
        """P(a draft at `depth` with conditional confidence q is right | its parent is)."""
        key = self.cell(depth, q)
        hits, expected = self.hits.get(key, 0.0), self.expected.get(key, 0.0)
        return min(q * (hits + self.weight) / (expected + self.weight), MAX_RATE)

    def survival(self, parents: Sequence[int], conditionals: Sequence[float]) -> list[float]:
        out: list[float] = []
        depths: list[int] = []
        for par, q in zip(parents, conditionals):
            depths.append(1 if par < 0 else depths[par] + 1)
            out.append((1.0 if par < 0 else out[par]) * self.rate(depths[-1], q))
        return out

    def record(self, tokens: Sequence[int], parents: Sequence[int], conditionals: Sequence[float],
               truth: Sequence[int]) -> None:
        """Score every draft whose parent matched `truth` (the tokens the target emitted after the anchor)."""
        on_path: list[bool] = []
        depths: list[int] = []
        for tok, par, q in zip(tokens, parents, conditionals):
            depths.append(1 if par < 0 else depths[par] + 1)
            d = depths[-1]
            if (par >= 0 and not on_path[par]) or d > len(truth):
                on_path.append(False)
                continue
            hit = int(tok) == int(truth[d - 1])
            key = self.cell(d, q)
            self.hits[key] = self.hits.get(key, 0.0) * self.decay + hit
            self.expected[key] = self.expected.get(key, 0.0) * self.decay + q
            on_path.append(hit)


def conditionals(p: Proposal) -> list[float]:
    """Each draft's own confidence given its parent: s_i / s_parent (UNKNOWN_CONFIDENCE without survival)."""
    if p.survival is None:
        return [UNKNOWN_CONFIDENCE] * len(p)
    s = p.survival.tolist()
    out = []
    for par, si in zip(p.parents.tolist(), s):
        above = 1.0 if par < 0 else s[par]
        out.append(min(max(si / above, 0.0), 1.0) if above > 0 else 0.0)
    return out


def tree_order(survival: Sequence[float], parents: Sequence[int]) -> list[int]:
    """Node indices, each the highest-survival child of the nodes before it (ties: lowest index):
    every prefix is a subtree closed under parents."""
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        children.setdefault(int(par), []).append(i)
    frontier = [(-survival[i], i) for i in children.get(-1, [])]
    heapq.heapify(frontier)
    order = []
    while frontier:
        _, i = heapq.heappop(frontier)
        order.append(i)
        for c in children.get(i, []):
            heapq.heappush(frontier, (-survival[c], c))
    return order


def subtree(p: Proposal, keep: Sequence[int], survival: Sequence[float] | None = None) -> Proposal:
    """The nodes `keep` of p (closed under parents), in p's order, with `survival` (default p's)."""
    keep = sorted(keep)
    new_index = {old: new for new, old in enumerate(keep)}
    parents_old = p.parents.tolist()
    parents = torch.tensor([-1 if parents_old[i] < 0 else new_index[parents_old[i]] for i in keep], dtype=torch.long)
    index = torch.tensor(keep, dtype=torch.long)
    probs = None if p.draft_probs is None else p.draft_probs[index]
    if survival is not None:
        surv = torch.tensor([survival[i] for i in keep], dtype=torch.float32)
    else:
        surv = None if p.survival is None else p.survival[index]
    is_chain = bool(torch.equal(parents, torch.arange(-1, len(keep) - 1)))
    return Proposal(p.tokens[index], parents, probs, is_chain, _depth(parents), surv)


def sized(p: Proposal, survival: Sequence[float], cost: tuple[float, float],
          free_first: bool = False) -> tuple[Proposal, float, float]:
    """p cut to the drafts maximising expected tokens per second under `cost` (c0, c1; the drafter's
    own cost already in c0), with `survival` as its survival; (proposal, tokens/s, expected tokens)."""
    if p.is_chain:
        length, rate = best_length(list(survival), cost, free_first)
        keep = list(range(length))
    else:
        order = tree_order(survival, p.parents.tolist())
        length, rate = best_length([survival[i] for i in order], cost, free_first)
        keep = order[:length]
    expected = 1.0 + sum(survival[i] for i in keep)
    return subtree(p, keep, survival), rate, expected


# idle rounds after a sizing that did not pay for itself, doubling up to MAX_IDLE for greedy requests
# (greedy text has stretches where nothing lands between ones that copy: a long gap misses the copies
# that follow; on the int4 DFlash folder a gap of 32 cut its tau on MT-bench from 3.3 to 2.3) and up
# to MAX_IDLE_SAMPLED for sampled ones (nothing lands and nothing comes back)
FIRST_IDLE, MAX_IDLE, MAX_IDLE_SAMPLED = 2, 8, 32
MIN_SIZED = 16  # sized rounds of a request before it may idle (its first rounds may not copy yet)


class IdleRounds:
    """Whether sizing a round pays for itself (module docstring: idle rounds), per request, with what
    earlier requests of the same sampling settings learned (`begin`)."""

    _LEARNED = ("accepted", "seconds", "extra", "plain_seconds", "gap", "rounds")

    def __init__(self, decay: float = 0.95) -> None:
        # a slow mean (~20 rounds): greedy text has stretches where nothing lands between ones that
        # copy, and an idle gap there misses the copies that follow
        self.decay = float(decay)
        self.key: object = None  # the sampling settings of the request in flight (`begin`)
        self.learned: dict[object, tuple] = {}  # per sampling settings: the state the last request left
        self._fresh()

    def _fresh(self) -> None:
        self.accepted: float | None = None  # decayed mean of the drafts accepted per sized round
        self.seconds: float | None = None  # decayed mean of a sizing's seconds
        self.extra: float | None = None  # decayed mean of a sized round's verify seconds beyond a plain step's
        self.plain_seconds = 0.0  # a one-token step's seconds at the last sizing
        self.left = 0  # idle rounds still to run
        self.gap = FIRST_IDLE
        self.sized = False  # the last round was sized (its accepted drafts are scored)
        self.rounds = 0  # sized rounds scored (in this request, or carried over by `begin`)

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def idle(self) -> bool:
        """True for a round to run as a plain step without sizing."""
        self.sized = self.left == 0
        if self.sized:
            return False
        self.left -= 1
        return True

    def observe_sizing(self, seconds: float, plain_seconds: float) -> None:
        self.seconds = timed_mean(self.seconds, seconds, self.decay)  # a stall clipped (step_cost.py)
        self.plain_seconds = plain_seconds

    def observe_verify(self, seconds: float) -> None:
        """The last round's verify seconds (forward and acceptance), before its accepted drafts."""
        if self.sized and self.seconds is not None:
            self.extra = self._mean(self.extra, seconds - self.plain_seconds)

    def observe_accepted(self, drafts: int) -> None:
        """The drafts the target accepted in the last round; after a sized one, the idle decision."""
        if not self.sized or self.seconds is None:
            return
        self.sized = False  # scored once: a round of another arm (`--drafter auto`) is not this one's
        self.accepted = self._mean(self.accepted, float(drafts))
        self.rounds += 1
        if self.rounds >= MIN_SIZED and self.accepted * self.plain_seconds < self.seconds + (self.extra or 0.0):
            cap = MAX_IDLE if self.key in (None, "greedy") else MAX_IDLE_SAMPLED
            self.left, self.gap = self.gap, min(2 * self.gap, cap)
        else:
            self.gap = FIRST_IDLE

    def forget(self) -> None:
        """A new request (or rows reset): start afresh, keeping what this one learned for `begin`."""
        if self.key is not None:
            self.learned[self.key] = tuple(getattr(self, name) for name in self._LEARNED)
        self.key = None
        self._fresh()

    def begin(self, sampling) -> None:
        """The request about to run samples with `sampling`: pick up what the last request with the
        same settings learned (its first round is sized all the same)."""
        self.key = sampling.distribution
        state = self.learned.get(self.key)
        if state is not None:
            for name, value in zip(self._LEARNED, state):
                setattr(self, name, value)


class VerifyLength:
    """One proposer's sizing state: the drafter's record and cost, its past rounds, drafts not yet scored."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = float(decay)
        self.record = DraftRecord()
        self.draft_seconds: float | None = None  # decayed mean of the drafter's propose time
        self.round_tokens: float | None = None  # decayed means of the drafter's sized rounds (its own drafts)
        self.round_rows: float | None = None
        self.skips = 0  # rounds in a row that skipped the drafter
        self.reask = REASK  # rounds skipped before the drafter is asked anyway
        self.pending: dict[int, tuple[object, int, list[int], list[int], list[float]]] = {}

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def observe_draft(self, seconds: float) -> None:
        self.draft_seconds = timed_mean(self.draft_seconds, seconds, self.decay)  # a stall clipped (step_cost.py)

    def observe_round(self, expected_tokens: float, rows: int) -> None:
        """What the drafter's own drafts were worth this round, at the size they were cut to."""
        self.round_tokens = self._mean(self.round_tokens, expected_tokens)
        self.round_rows = self._mean(self.round_rows, float(rows))

    def with_draft(self, cost: tuple[float, float]) -> tuple[float, float]:
        return cost[0] + (self.draft_seconds or 0.0), cost[1]

    def drafter_rate(self, cost: tuple[float, float]) -> float | None:
        """Expected tokens per second of a drafter round at today's costs (None before one was seen)."""
        if self.round_tokens is None or self.draft_seconds is None:
            return None
        c0, c1 = self.with_draft(cost)
        return self.round_tokens / (c0 + c1 * self.round_rows)

    def should_skip(self, cost: tuple[float, float], rate_without: float) -> bool:
        """True when the drafter is expected to be slower than `rate_without` (asked anyway after
        `reask` skipped rounds, a gap that doubles while it keeps not paying)."""
        rate = self.drafter_rate(cost)
        if rate is None or rate >= rate_without:
            self.skips, self.reask = 0, REASK
            return False
        if self.skips + 1 >= self.reask:
            self.skips, self.reask = 0, min(2 * self.reask, MAX_REASK)
            return False
        self.skips += 1
        return True

    def chain_stop(self, cost: tuple[float, float], free_first: bool = False):
        """A stop rule for a chain drafted level by level (`Eagle3Proposer.stop_rule`): given the
        conditional confidences so far, True once no deeper draft can raise the round's tokens per
        second under `cost` (the drafter's cost in). A deeper draft survives at most s_L * MAX_RATE, and
        drafts each worth at most c1 * R* per row cannot lift a round above its best prefix rate R*."""
        def stop(conds: list[float]) -> bool:
            survival = self.record.survival(range(-1, len(conds) - 1), conds)
            best = best_length(survival, cost, free_first)[1]
            return survival[-1] * MAX_RATE <= cost[1] * best
        return stop

    # ---------------------------------------------------------------- scoring past drafts
    def remember(self, row: int, history: list[int], p: Proposal, conds: list[float]) -> None:
        """p was drafted after `history` (the row's committed tokens and its anchor, a list that grows)."""
        self.pending[row] = (history, len(history), p.tokens.tolist(), p.parents.tolist(), conds)

    def score(self, row: int, history: list[int]) -> None:
        """Score the row's last remembered drafts against what followed them in `history`."""
        last = self.pending.get(row)
        if last is None:
            return
        hist, start, tokens, parents, conds = last
        if hist is not history:  # the row started over (a new request on it)
            del self.pending[row]
            return
        if len(history) <= start:  # nothing committed since
            return
        del self.pending[row]
        self.record.record(tokens, parents, conds, history[start:])

    def forget(self) -> None:
        self.pending.clear()
        self.skips, self.reask = 0, REASK
