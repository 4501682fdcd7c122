"""Drafts looked up in the request's own text: prompt lookup, alone or grafted onto a drafter's tree.

Why. A small target repeats itself: SmolLM2-135M's greedy answers to MT-bench quote the prompt,
restate lists and fall into loops. Replayed over its plain greedy output for the 80 first turns
(256 tokens), continuing the longest earlier match of the current suffix and verifying up to 8
copied tokens every step would give tau ~2.0; how often the first copied token is right grows with
the length of the match (~.2 after a 1-token match, ~.5 after 2, ~.95 after 6 or more, where the
text loops). A lookup costs a few dict probes on the host and no drafter forward, so on a CPU its
drafts cost only their verify rows (docs/results.md).

How (`NgramIndex`, one per request row). The row's history is every committed token plus the
anchor. For n = 1..max_match the index maps each n-gram to the position right after its most
recent occurrence whose next token is known, updated as tokens arrive (n dict writes per token).
To draft, take the longest suffix of the history (n from max_match down to min_match) that occurred
before and copy up to `max_tokens` tokens that followed it; a copy that runs into the end of the
history continues from its own start (a loop of period p repeats with period p).

`LookupProposer` drafts that chain alone (`--drafter lookup`: speculation on a target with no
drafter at all). `WithLookup(inner)` grafts the chain onto another proposer's proposal: it walks
the chain down the inner tree, reusing a node where the inner tree already has that token under
the same parent and appending new nodes (children of the last matching node) where it does not.
The verify step then checks both; the accepted path is whichever the target agrees with further.

Lossless. The lookup drafts are chosen deterministically from committed tokens, so verification
treats them as point masses (`draft_probs` None, or a one-hot row beside a sampling drafter's rows;
`specrt.runtime.verify` explains why a point mass is exact for drafts chosen in any way). Grafting
never removes or reorders the inner proposal's nodes, so a sampled inner chain keeps its
proposal distributions.

Gating and survival. Each copied token's chance of being right is estimated from the proposer's
own record since the last `reset` (one generate call; a serving batcher's lifetime): per length of
the suffix match and per draft depth d, how often the d-th copied token matched what the target
emitted, given the d-1 before it did (a Beta(1, 1) prior). A copy is verified while the product of
those rates stays at least `threshold` (loops get long copies, one-token matches short ones or
none), and a copy whose first token is at least `alone_above` likely is verified without asking
the drafter at all. A grafted node's survival (read by the serving scheduler) is at most its
parent's, so it never increases along a path.

Copies from a store (`datastore.py`). With an engine folder's datastore.npz, the store's greedy walk
over the target's earlier answers is a second candidate each step; the record keeps its rates
apart (negative match keys) and the step verifies whichever candidate expects more accepted
tokens. `free_first`: on engines that compute a whole second row anyway (int8-activation folders whose
fused graph takes no attention rows: `OrtTargetModel.full_copy_row`) one copy is verified whatever
its estimate. The drafter-free `LookupProposer` of a greedy request sizes its copy
by the step cost it measures (`step_cost.py`) instead of the threshold, and with `tree` verifies a
disagreeing second candidate as its own branch.

Chains only on int8-activation engines (see `backends.ort_backend.exact_chain_options`): there the
proposal must stay a chain, so `chain_only` verifies one chain per step: the copy when its summed
survival beats the drafter chain's, else the drafter's (`graft_chain`).

Sized drafter rounds. `WithLookup` measures step costs too (`observe_step_time`; under `--drafter
auto` it shares the copies' line) and the time of its drafter's `propose`. A greedy round at batch 1
with a measured line is sized whole by `verify_length.py`: the copies alone when the drafter is not
expected to pay, else the drafter's drafts, with survivals calibrated by what the target accepted,
cut (chain) or pruned to a subtree (tree, copies grafted in) at the size with the most expected
tokens per second, the drafter's own cost counted; chain-only engines verify whichever of the cut
drafter chain and the cut copy expects more tokens per second. Sampled rounds, batches and rounds
before the line is measured keep the threshold rules above.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from specrt.export.draft_options import (
    DEFAULT_ALONE_ABOVE,
    DEFAULT_LOOKUP_THRESHOLD,
    DEFAULT_LOOKUP_TOKENS,
    DEFAULT_MAX_MATCH,
    DEFAULT_MIN_MATCH,
    check_lookup_settings,
)
from specrt.runtime.proposers.backlog import DrafterBacklog
from specrt.runtime.proposers.base import Proposal, _depth, coupled
from specrt.runtime.sampling import SamplingParams

from specrt.runtime.proposers.datastore import store_key
from specrt.runtime.proposers.step_cost import StepCost, best_length
from specrt.runtime.proposers.verify_length import IdleRounds, VerifyLength, conditionals, sized

if TYPE_CHECKING:
    from specrt.runtime.proposers.datastore import NgramDatastore
    from specrt.runtime.proposers.lookup_prior import LookupPrior

STORE_MAX_TOKENS = 8  # copies from the datastore per step at most (its hit rates fall fast with depth)


class NgramIndex:
    """One row's history and the last position that followed each of its n-grams (n <= max_match)."""

    def __init__(self, max_match: int) -> None:
        self.max_match = max_match
        self.tokens: list[int] = []
        self.after: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_match + 1)]

    def extend(self, tokens: Sequence[int]) -> None:
        hist, after = self.tokens, self.after
        for tok in tokens:
            j = len(hist)
            # hist[j-n:j] is followed by the token arriving at j: the most recent occurrence wins
            for n in range(1, min(self.max_match, j) + 1):
                after[n][tuple(hist[j - n:j])] = j
            hist.append(int(tok))

    def continuation(self, max_tokens: int, min_match: int) -> tuple[list[int], int]:
        """(tokens that followed the longest earlier match of the history's suffix, match length)."""
        hist = self.tokens
        for n in range(min(self.max_match, len(hist) - 1), min_match - 1, -1):
            j = self.after[n].get(tuple(hist[len(hist) - n:]))
            if j is None:
                continue
            out: list[int] = []
            while len(out) < max_tokens:
                # past the end of the history the copy reads its own tokens: a loop keeps its period
                out.append(hist[j] if j < len(hist) else out[j - len(hist)])
                j += 1
            return out, n
        return [], 0


@dataclass
class HitRecord:
    """Per match length n and draft depth d: how often a copied token matched what the target committed.

    A 1-token match is a weak cue (its first copy is right ~1 time in 5 on MT-bench), a 6-token one
    is a loop (right ~19 times in 20): the rates are kept per match length, capped at max_match."""

    trials: dict[int, list[int]] = field(default_factory=dict)
    hits: dict[int, list[int]] = field(default_factory=dict)
    prior: "LookupPrior | None" = None  # calibrated rates (lookup_prior.py); None: Beta(1, 1)

    def rate(self, match: int, depth: int) -> float:
        """P(copy at depth d right | the d-1 before it right) after a match of length `match`;
        depth counts from 1. Without a record: the calibrated prior's rate (weight w pseudo-trials),
        or a Beta(1, 1) prior."""
        trials = self.trials.get(match, ())
        n, k = (trials[depth - 1], self.hits[match][depth - 1]) if depth <= len(trials) else (0, 0)
        if self.prior is None:
            return (k + 1) / (n + 2)
        w = self.prior.weight
        return (k + w * self.prior.rate(match, depth)) / (n + w)

    def survival(self, match: int, n: int, start: float = 1.0) -> list[float]:
        """P(copies 1..d all right) for d = 1..n, times `start` (the parent's survival)."""
        out, s = [], start
        for d in range(1, n + 1):
            s *= self.rate(match, d)
            out.append(s)
        return out

    def record(self, match: int, drafted: Sequence[int], truth: Sequence[int]) -> None:
        """drafted: the copied chain; truth: the tokens the target emitted after the same anchor."""
        trials = self.trials.setdefault(match, [])
        hits = self.hits.setdefault(match, [])
        for i, (d, t) in enumerate(zip(drafted, truth)):
            if len(trials) <= i:
                trials.append(0)
                hits.append(0)
            trials[i] += 1
            if d != t:
                return
            hits[i] += 1


def record_key(sampling: SamplingParams, seeded_sampling: str = "noise") -> object:
    """Which requests share a copy record (`NgramLookup.begin`): sampled ones with the same temperature,
    top-k and top-p, or None (a fresh record per request).

    Why. The calibrated prior (lookup.json) is greedy text's: a copy inside a loop is right ~19 times in
    20 there, while text sampled at temperature 1 takes it ~1 time in 7 (int4 SmolLM2, MT-bench), and a
    request of a few hundred tokens spreads too few trials over the match lengths to leave the prior.
    So a sampled request starts from what the last one sampled alike learned. Greedy requests keep a
    fresh record on the prior, and so do seeded requests whose seed drives rejection sampling's coins
    ("stream"): what they draft must not depend on earlier requests, or a seed would consume its
    stream differently from run to run. Under the default seeded rule a seed's text depends on the
    seed alone, whatever is drafted."""
    if sampling.greedy or (sampling.seed is not None and seeded_sampling != "noise"):
        return None
    return sampling.distribution


@dataclass
class LookupChain:
    tokens: list[int]
    match: int  # length of the suffix match the copy came from (0: none)
    survival: list[float]  # the record's estimate for each copy, non-increasing


class NgramLookup:
    """The lookup state of a batch: one index per row, the last chain drafted per row, the record."""

    def __init__(self, max_tokens: int = DEFAULT_LOOKUP_TOKENS, min_match: int = DEFAULT_MIN_MATCH,
                 max_match: int = DEFAULT_MAX_MATCH, threshold: float = DEFAULT_LOOKUP_THRESHOLD,
                 prior: "LookupPrior | None" = None, datastore: "NgramDatastore | None" = None,
                 free_first: bool = False) -> None:
        check_lookup_settings(max_tokens, min_match, max_match, threshold)
        self.max_tokens, self.min_match, self.max_match = int(max_tokens), int(min_match), int(max_match)
        self.threshold = float(threshold)
        self.prior = prior
        self.datastore = datastore or None  # copies from the target's earlier text (datastore.py); False: none
        # the step computes a second row anyway (int8-activation engines decode one token as two rows):
        # a one-token copy costs nothing there, whatever its estimate
        self.free_first = bool(free_first)
        # per sampling settings of sampled requests, the record they left (`begin`)
        self.learned: dict[object, HitRecord] = {}
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        # a fresh record per generate call: what is drafted must not depend on earlier calls, or the
        # same seed would consume its random stream differently and give other text; `begin` hands a
        # sampled request whose text no stream of drafts changes the record of requests sampled alike.
        # (A serving batcher resets once and frees rows one by one, so there the record spans requests.)
        self.record = HitRecord(prior=self.prior)
        self.index = [NgramIndex(self.max_match) for _ in range(batch_size)]
        self.lengths = [0] * batch_size  # committed tokens per row (the anchor is indexed, not counted)
        # per row, every candidate copy of the last step (own text, store, whole, with their survivals),
        # scored once the target answers
        self.candidates: list[list[LookupChain]] = [[] for _ in range(batch_size)]

    def begin(self, key: object) -> None:
        """The request about to run (after `reset`): with a key (`record_key`), continue the record the
        last request with the same key left instead of the fresh one."""
        if key is not None:
            self.record = self.learned.setdefault(key, self.record)

    def reset_row(self, row: int) -> None:
        self.index[row] = NgramIndex(self.max_match)
        self.lengths[row] = 0
        self.candidates[row] = []

    def observe(self, rows, tokens, next_tokens) -> None:
        for b, toks, nxt in zip(rows, tokens, next_tokens):
            toks = [int(t) for t in toks]
            index = self.index[b]
            for last in self.candidates[b]:
                # what the target emitted after the old anchor: the accepted drafts, then the bonus.
                # Every candidate is scored whole (also the one not chosen, and the part the threshold
                # kept out of the verify step), so each source's rates follow the text.
                self.record.record(last.match, last.tokens, toks[1:] + [int(nxt)])
            self.candidates[b] = []
            # the old anchor (toks[0]) is already the last indexed token, unless the row is new
            new = toks[1:] if index.tokens else toks
            index.extend(new + [int(nxt)])
            self.lengths[b] += len(toks)

    def above_threshold(self, survival: Sequence[float]) -> int:
        """How many leading copies keep an estimated survival of at least the threshold."""
        keep = 0
        while keep < len(survival) and survival[keep] >= self.threshold:
            keep += 1
        return keep

    def chain(self, row: int, cost: tuple[float, float] | None = None,
              walk_cost: tuple[float, float] | None = None) -> LookupChain:
        """Row's copy, cut where its estimated survival falls below the threshold, or, with a step
        cost line (c0, c1; `step_cost.py`), at the length that maximises expected tokens per second.
        The candidates stay in `candidates[row]` (scored once the target answers; `pick` sizes them
        again at another cost). walk_cost: the cheapest cost this round's candidates will be sized at
        (default `cost`): the store's walk stops where no cut at that cost would keep a copy.

        The cut depends only on committed tokens, past records and past step times, never on this
        step's target output, so verification stays lossless."""
        tokens, match = self.index[row].continuation(self.max_tokens, self.min_match)
        candidates = [LookupChain(tokens, match, self.record.survival(match, len(tokens)))] if match else []
        if self.datastore is not None:
            # a store copy is rarely right for long (its text is another request's): 8 at most
            floor, inclusive = self._floor(walk_cost or cost)

            def go_on(first: int, taken: int) -> bool:
                survival = self.record.survival(store_key(first), taken + 1)[-1]
                return survival >= floor if inclusive else survival > floor

            stored, stored_match = self.datastore.chain(self.index[row].tokens, min(self.max_tokens, STORE_MAX_TOKENS),
                                                        go_on)
            if stored_match:
                key = store_key(stored_match)
                candidates.append(LookupChain(stored, key, self.record.survival(key, len(stored))))
        self.candidates[row] = candidates
        return self.pick(row, cost)

    def _floor(self, cost: tuple[float, float] | None) -> tuple[float, bool]:
        """(survival, inclusive): a copy at or below it (below it, when inclusive) is never kept.

        Threshold rule: copies are kept while their survival is at least the threshold. Cost rule
        (`best_length`): survivals fall along a copy, and a last copy with survival s lowers a cut's
        rate R iff s < c1 R (a tie keeps the shorter cut), so a copy with s <= c1 R0, R0 the rate of
        a round that verifies nothing, is never kept."""
        if cost is None:
            return self.threshold, True
        c0, c1 = cost
        return c1 / (c0 + c1 * (2 if self.free_first else 1)), False

    def pick(self, row: int, cost: tuple[float, float] | None = None) -> LookupChain:
        """The row's candidate expecting the most accepted copies (per second, with a cost), cut."""
        candidates = self.candidates[row]
        best, best_score = LookupChain([], 0, []), 0.0
        for c in candidates:
            if cost is not None:
                keep, score = best_length(c.survival, cost, self.free_first)
            else:
                keep = self.above_threshold(c.survival)
                score = sum(c.survival[:keep])
            if keep and score > best_score:
                best, best_score = LookupChain(c.tokens[:keep], c.match, c.survival[:keep]), score
        if not best.tokens and self.free_first and candidates:
            c = max(candidates, key=lambda c: c.survival[0])
            best = LookupChain(c.tokens[:1], c.match, c.survival[:1])
        return best


class LookupProposer:
    """Speculation without a drafter: each row's draft is the lookup chain (module docstring)."""

    name = "lookup"
    tap_layers: tuple[int, ...] = ()
    free_drafts = True  # no drafter forward: the serving draft gate has nothing to save

    def __init__(self, max_tokens: int = DEFAULT_LOOKUP_TOKENS, min_match: int = DEFAULT_MIN_MATCH,
                 max_match: int = DEFAULT_MAX_MATCH, threshold: float = DEFAULT_LOOKUP_THRESHOLD,
                 prior: "LookupPrior | None" = None, datastore: "NgramDatastore | None" = None,
                 free_first: bool = False, tree: bool = False) -> None:
        self.lookup = NgramLookup(max_tokens, min_match, max_match, threshold, prior, datastore, free_first)
        # tree: a second copy that disagrees with the first is verified as its own branch (engines
        # exact on trees only; int8-activation engines verify chains)
        self.tree = bool(tree)
        self.max_drafts = 2 * self.lookup.max_tokens if self.tree else self.lookup.max_tokens
        self.step_cost = StepCost()  # the loop reports its verify step times (observe_step_time)
        self.idle = IdleRounds()  # rounds whose lookup does not pay for itself run as plain steps

    @property
    def lengths(self) -> list[int]:
        return self.lookup.lengths

    @property
    def batch_size(self) -> int:
        return len(self.lookup.lengths)

    def reset(self, batch_size: int, capacity: int) -> None:
        self.lookup.reset(batch_size)
        self.idle.forget()

    def begin_request(self, sampling: SamplingParams, seeded_sampling: str = "noise") -> None:
        # what earlier requests sampled alike taught the idle rule (copies do not depend on what a seed
        # drives) and, where drafts may depend on earlier requests, the copy record (`record_key`)
        self.idle.begin(sampling)
        self.lookup.begin(record_key(sampling, seeded_sampling))

    def reset_row(self, row: int) -> None:
        self.lookup.reset_row(row)

    def context_length(self, row: int) -> int:
        return self.lookup.lengths[row]

    def observe(self, rows, tokens, taps, next_tokens) -> None:
        self.lookup.observe(rows, tokens, next_tokens)
        if list(rows) == [0] and self.batch_size == 1:
            self.idle.observe_accepted(len(tokens[0]) - 1)

    def observe_step_time(self, batch: int, positions: int, seconds: float) -> float:
        seconds = self.step_cost.observe(batch, positions, seconds)  # a stall clipped (step_cost.py)
        if batch == 1:
            self.idle.observe_verify(seconds)
        return seconds

    def propose(self, rows, anchors, sampling: SamplingParams, generator) -> list[Proposal]:
        # measured costs choose the copy length for greedy requests only: a sampled request's drafts
        # must not depend on timing (its random stream would be consumed differently run to run)
        if self.idle.left and sampling.greedy and self.batch_size == 1 and list(rows) == [0]:
            self.idle.idle()  # an idle round (`verify_length.IdleRounds`): nothing to look up or size
            return [NO_COPY]
        cost = self.step_cost.line(self.batch_size) if sampling.greedy else None
        alone = cost is not None and self.batch_size == 1 and list(rows) == [0]
        if alone and self.idle.idle():  # `verify_length.IdleRounds`
            return [NO_COPY]
        start = time.perf_counter()
        out = []
        for b in rows:
            best = self.lookup.chain(b, cost)
            p = copy_proposal(best)
            if self.tree and best.tokens:
                p = self._with_second_branch(p, best, b, cost)
            out.append(p)
        if alone:
            self.idle.observe_sizing(time.perf_counter() - start, cost[0] + cost[1])
        return out

    def _with_second_branch(self, p: Proposal, best: LookupChain, row: int, cost) -> Proposal:
        """The other candidate (own text or store) as a second branch, as long as it pays: by the
        step cost where one is measured, else while its survival stays above the threshold. Two
        copies that disagree on a token are exclusive events, so their survivals add."""
        others = [c for c in self.lookup.candidates[row] if c.tokens and c.tokens[0] != best.tokens[0]]
        if not others:
            return p
        other = max(others, key=lambda c: c.survival[0])
        if cost is not None:
            keep, _ = best_length(other.survival, cost, expected=1.0 + sum(best.survival), rows=1 + len(best.tokens))
        else:
            keep = self.lookup.above_threshold(other.survival)
        if keep == 0:
            return p
        return graft_tree(p, LookupChain(other.tokens[:keep], other.match, other.survival[:keep]))


class WithLookup:
    """Another proposer's drafts with the lookup chain grafted on (module docstring)."""

    def __init__(self, inner, max_tokens: int = DEFAULT_LOOKUP_TOKENS, min_match: int = DEFAULT_MIN_MATCH,
                 max_match: int = DEFAULT_MAX_MATCH, threshold: float = DEFAULT_LOOKUP_THRESHOLD,
                 chain_only: bool = False, alone_above: float = DEFAULT_ALONE_ABOVE,
                 prior: "LookupPrior | None" = None, datastore: "NgramDatastore | None" = None,
                 free_first: bool = False) -> None:
        self.inner = inner
        self.alone_above = float(alone_above)
        self.lookup = NgramLookup(max_tokens, min_match, max_match, threshold, prior, datastore, free_first)
        self.chain_only = chain_only
        self.last_chains: dict[int, LookupChain] = {}
        self.name = f"{inner.name}+lookup"
        self.tap_layers = tuple(inner.tap_layers)
        # a chain-only graft replaces the inner chain, so it is never longer than the longer of the two
        self.max_drafts = (max(inner.max_drafts, self.lookup.max_tokens) if chain_only
                           else inner.max_drafts + self.lookup.max_tokens)
        # greedy rounds at batch 1 are sized by measured costs (`verify_length.py`); cost_cut False
        # keeps the threshold rules alone (the benchmark toggles it to compare)
        self.step_cost = StepCost()  # the loop reports its verify step times (observe_step_time)
        self.sizing = VerifyLength()
        self.idle = IdleRounds()  # sized rounds that do not pay for their sizing run as plain steps
        self.cost_cut = True
        # committed tokens the drafter ingests only when it next drafts (`backlog.py`)
        self.backlog = DrafterBacklog(inner)

    # the serving batcher reads and sets the confidence threshold of the drafter it drives
    @property
    def threshold(self) -> float:
        return self.inner.threshold

    @threshold.setter
    def threshold(self, value: float) -> None:
        self.inner.threshold = value

    @property
    def batch_size(self) -> int:
        return len(self.lookup.lengths)

    @property
    def lengths(self) -> list[int]:
        return self.inner.lengths

    def __getattr__(self, name: str):
        # other attributes the serving code probes on a drafter (block_size, ...): the inner one's
        if name in ("inner", "__setstate__", "__deepcopy__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self, batch_size: int, capacity: int) -> None:
        self.inner.reset(batch_size, capacity)
        self.lookup.reset(batch_size)
        self.sizing.forget()
        self.idle.forget()
        self.backlog.drop()

    def begin_request(self, sampling: SamplingParams, seeded_sampling: str = "noise") -> None:
        # what earlier requests sampled alike taught the idle rule (copies do not depend on what a seed
        # drives) and, where drafts may depend on earlier requests, the copy record (`record_key`)
        self.idle.begin(sampling)
        self.lookup.begin(record_key(sampling, seeded_sampling))

    def reset_row(self, row: int) -> None:
        from specrt.runtime.serving.rows import reset_proposer_row

        reset_proposer_row(self.inner, row)
        self.lookup.reset_row(row)
        self.backlog.drop(row)

    def observe_step_time(self, batch: int, positions: int, seconds: float) -> float:
        seconds = self.step_cost.observe(batch, positions, seconds)  # a stall clipped (step_cost.py)
        if batch == 1:
            self.idle.observe_verify(seconds)
        return seconds

    def prefix_view(self, hi: int) -> "WithLookup":
        """Rows 0..hi-1 (serving): the inner proposer's view over the same lookup state."""
        import copy

        from specrt.runtime.serving.rows import proposer_prefix_view

        view = copy.copy(self)
        view.inner = proposer_prefix_view(self.inner, hi)
        return view

    def context_length(self, row: int) -> int:
        return self.inner.context_length(row) + self.backlog.held(row)

    def observe(self, rows, tokens, taps, next_tokens) -> None:
        self.observe_drafter(rows, tokens, taps, next_tokens)
        self.observe_copies(rows, tokens, next_tokens)

    # The decode step and the serving batcher feed the two halves apart: the lookup every step (its
    # index and record must see each committed token before the next copy), the drafter's backlog
    # (`backlog.py`) to be ingested when it next drafts; a row's first tokens (the prompt, at
    # prefill) are ingested at once.
    def observe_drafter(self, rows, tokens, taps, next_tokens) -> None:
        if all(self.inner.context_length(b) for b in rows):
            self.backlog.hold(rows, tokens, taps, next_tokens)
        else:
            self.backlog.catch_up()
            self.inner.observe(rows, tokens, taps, next_tokens)

    def observe_copies(self, rows, tokens, next_tokens) -> None:
        self.lookup.observe(rows, tokens, next_tokens)
        if list(rows) == [0] and self.batch_size == 1:
            self.idle.observe_accepted(len(tokens[0]) - 1)

    def propose_copies(self, rows) -> list[Proposal]:
        """The copies alone, no drafter forward (serving, while its draft gate is closed)."""
        return [copy_proposal(self.lookup.chain(b)) for b in rows]

    def propose(self, rows, anchors, sampling: SamplingParams, generator, noise=None) -> list[Proposal]:
        # noise: seeded rows' couplings, for an inner drafter that `couples_noise` (this class's
        # attribute lookup falls through to the inner proposer's)
        self.backlog.clear_last()
        # measured costs size greedy rounds at batch 1; a sampled request's drafts must not depend on timing
        sizable = self.cost_cut and sampling.greedy and self.batch_size == 1 and list(rows) == [0]
        if sizable and self.idle.left:
            self.idle.idle()  # an idle round (`verify_length.IdleRounds`): nothing to size
            return [NO_COPY]
        cost = self.step_cost.line(1) if sizable else None
        if cost is not None:
            if self.idle.idle():
                return [NO_COPY]
            start = time.perf_counter()
            p = self._sized_round(anchors[0], sampling, generator, cost, noise)
            self.idle.observe_sizing(time.perf_counter() - start, cost[0] + cost[1])
            return [p]
        chains = {b: self.lookup.chain(b) for b in rows}
        # this step's copies, per row: the serving gate compares the drafter against them alone
        # (one dict shared with prefix views, so every sampling group's call lands in it)
        self.last_chains.update(chains)
        # a confident copy (inside a loop, say) is verified alone: the drafter's forward is skipped.
        # The choice reads only the history, never this step's target output: still lossless.
        ask = [b for b in rows if not chains[b].survival or chains[b].survival[0] < self.alone_above]
        if ask and hasattr(self.inner, "block_size"):
            # a block drafter writes scratch K/V over the context of every row it is not asked about
            # (`BlockProposer.propose`), and drafts all rows in one forward anyway: ask for all of them
            ask = list(rows)
        anchor_of = dict(zip(rows, anchors))
        noise_of = dict(zip(rows, noise)) if noise is not None else None
        asked_noise = None if noise_of is None else [noise_of[b] for b in ask]
        inner = dict(zip(ask, self._draft(ask, [anchor_of[b] for b in ask], sampling, generator, asked_noise))) if ask else {}
        out = []
        for b in rows:
            c = chains[b]
            if b not in inner:
                out.append(copy_proposal(c))
            elif self.chain_only:
                out.append(graft_chain(inner[b], c))
            else:
                out.append(graft_tree(inner[b], c))
        return out

    def _draft(self, rows, anchors, sampling: SamplingParams, generator, noise=None) -> list[Proposal]:
        """The drafter's proposals for `rows`, once it has ingested what it holds."""
        self.backlog.catch_up()
        return self.inner.propose(rows, anchors, sampling, generator, **coupled(noise))

    def _sized_round(self, anchor: int, sampling: SamplingParams, generator, cost: tuple[float, float],
                     noise=None) -> Proposal:
        """Row 0's round at the size with the most expected tokens per second (`verify_length.py`):
        the copies alone when the drafter is not expected to pay, else the drafter's drafts (and the
        copies: one chain or a grafted tree) cut by the drafter's calibrated survivals."""
        lookup, sizing, free_first = self.lookup, self.sizing, self.lookup.free_first
        history = lookup.index[0].tokens
        sizing.score(0, history)
        # sized for a round without the drafter; the store walks as far as a round with it could use
        copy = lookup.chain(0, cost, sizing.with_draft(cost))
        self.last_chains[0] = copy
        alone_rate = best_length(copy.survival, cost, free_first)[1]
        confident = bool(copy.survival) and copy.survival[0] >= self.alone_above
        if confident or sizing.should_skip(cost, alone_rate):
            return copy_proposal(copy)
        staged = "stop_rule" in vars(self.inner)  # a chain drafted level by level stops where depth cannot pay
        if staged:
            self.inner.stop_rule = sizing.chain_stop(sizing.with_draft(cost), free_first)
        self.backlog.catch_up()
        start = time.perf_counter()
        try:
            p = self.inner.propose([0], [anchor], sampling, generator, **coupled(noise))[0]
        finally:
            if staged:
                self.inner.stop_rule = None
        # the drafter's cost of a round: its forward, and its ingest of one round's tokens (a drafter
        # drafting every round ingests every round; one that sat out rounds caught up on them at once)
        seconds, rounds = self.backlog.last
        sizing.observe_draft(time.perf_counter() - start + seconds / max(rounds, 1))
        conds = conditionals(p)
        sizing.remember(0, history, p, conds)
        survival = sizing.record.survival(p.parents.tolist(), conds)
        with_draft = sizing.with_draft(cost)
        own, rate, expected = sized(p, survival, with_draft, free_first)
        sizing.observe_round(expected, 1 + len(own))
        if self.chain_only:
            # the copy replaces the drafter's chain where it expects more tokens per second
            for c in lookup.candidates[0]:
                keep, copy_rate = best_length(c.survival, with_draft, free_first)
                if keep and copy_rate > rate:
                    own, rate = copy_proposal(LookupChain(c.tokens[:keep], c.match, c.survival[:keep])), copy_rate
            return own
        # engines exact on trees: the copy (sized with the drafter's cost in) grafted on, the tree cut whole
        p = Proposal(p.tokens, p.parents, p.draft_probs, p.is_chain, p.depth, torch.tensor(survival, dtype=torch.float32))
        tree = graft_tree(p, lookup.pick(0, with_draft))
        return sized(tree, tree.survival.tolist(), with_draft, free_first)[0]


NO_COPY = Proposal.chain(torch.zeros(0, dtype=torch.long), None, torch.zeros(0))  # shared: proposals are never written


def copy_proposal(chain: LookupChain) -> Proposal:
    """A copy as a chain of point-mass drafts with its survival estimates."""
    if not chain.tokens:
        return NO_COPY
    return Proposal.chain(torch.tensor(chain.tokens, dtype=torch.long), None,
                          torch.tensor(chain.survival, dtype=torch.float32))


def graft_tree(p: Proposal, chain: LookupChain) -> Proposal:
    """p with the lookup chain merged in as a branch from the anchor (module docstring)."""
    if not chain.tokens:
        return p
    tokens = p.tokens.tolist()
    parents = p.parents.tolist()
    survival = None if p.survival is None else p.survival.tolist()
    children: dict[tuple[int, int], int] = {}
    for i, (par, tok) in enumerate(zip(parents, tokens)):
        children.setdefault((par, tok), i)  # the lowest index, as greedy tree verification picks
    added: list[int] = []
    cur = -1
    for depth, tok in enumerate(chain.tokens, start=1):
        node = children.get((cur, tok))
        if node is None:
            node = len(tokens)
            tokens.append(tok)
            parents.append(cur)
            added.append(node)
            if survival is not None:
                # below the parent (never increasing along a path), at most the copy's own estimate
                parent = survival[cur] if cur >= 0 else 1.0
                survival.append(min(parent, chain.survival[depth - 1]))
            children[(cur, tok)] = node
        cur = node
    if not added:
        return p
    probs = p.draft_probs
    if probs is not None:
        # one-hot rows: a point mass is the exact proposal law of a deterministic draft
        extra = torch.zeros(len(added), probs.shape[-1], dtype=probs.dtype, device=probs.device)
        extra[torch.arange(len(added)), torch.tensor([tokens[i] for i in added])] = 1.0
        probs = torch.cat([probs, extra])
    parents_t = torch.tensor(parents, dtype=torch.long)
    is_chain = bool(torch.equal(parents_t, torch.arange(-1, len(parents) - 1)))
    return Proposal(torch.tensor(tokens, dtype=torch.long), parents_t, probs, is_chain, _depth(parents_t),
                    None if survival is None else torch.tensor(survival, dtype=torch.float32))


def graft_chain(p: Proposal, chain: LookupChain) -> Proposal:
    """One chain, for engines that verify chains only: the lookup copy where it expects more accepted
    tokens than p (sum of survivals; a drafter without survivals counts .5 per draft), else p.

    The copy replaces p whole, as point masses: keeping p's sampled drafts only where they agree
    with the copy would choose them by their own tokens, which is not lossless."""
    if not chain.tokens:
        return p
    if not p.is_chain:
        raise ValueError("graft_chain needs a chain proposal")
    inner_gain = float(p.survival.sum()) if p.survival is not None else 0.5 * len(p)
    if sum(chain.survival) <= inner_gain:
        return p
    survival = torch.tensor(chain.survival, dtype=torch.float32) if p.survival is not None else None
    return Proposal.chain(torch.tensor(chain.tokens, dtype=torch.long), None, survival)
