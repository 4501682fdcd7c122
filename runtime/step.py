"""One decoding step, written once: `generate` (runtime/generate.py) and the serving batcher both run it.

A step advances a set of request rows of one target engine by one target forward:

  ingest  (lazy mode only) hand the proposer what the target committed since it last drafted
  draft   `proposer.propose` once per group of rows with the same draft sampling (a seeded row
          drafts greedily, on its verification's noise where the proposer `couples_noise`:
          `seeded.DraftNoise`); "copies" asks a grafted lookup for its copies alone; "none" (or no
          proposer) gives every row the empty proposal: plain decoding is this step too
  cut     each proposal to the row's free cache slots, then the caller's `plan` may cut further
          (the serving scheduler, DSpark Algorithm 1)
  verify  one forward over [anchor, drafts...] of every engine row (padded to the longest;
          rows not in the step get a one-token dummy that is never committed); a lone row's plain
          step takes the engine's `decode_one` where it has one (the ORT engine's bound call:
          no id, position or mask tensors, the token committed in place; a greedy row gets the
          argmax alone, taken in numpy: right after a call the interpreter's working set is out of
          the caches, and every torch op on the way to the next call costs tens of microseconds)
  accept  per row, by its `TokenRule`:
            greedy   temperature 0: the longest path equal to the target's argmax (`verify`)
            seeded   temperature > 0 and a seed: the same on log p + Gumbel noise keyed by
                     (seed, token index) (`seeded`): the text depends on prompt, settings and
                     seed only, whatever was drafted or batched
            sampled  no seed: rejection sampling with the row's generator (`verify`)
  commit  the target keeps the anchor and the accepted path (`kv_keep_indices`); the caller's
          `emit` takes accepted + bonus and says whether the row goes on; the proposer ingests
          the committed tokens and their taps for the rows that go on, now (eager) or before
          its next draft (lazy: the serving draft gate keeps plain steps free of drafter work).

A proposer that has decided a lone sampled row's next rounds are plain (`plain_run`, `--drafter
auto`) gets them as plain steps in one call, with one ingest at the end (`DecodeStep._plain_run`).

Every output is the target's: greedy token for token, sampled rows in distribution (DESIGN.md,
verification); the step only decides how much work a token costs.

The proposer contract is `specrt.runtime.proposers.base.Proposer` (propose / observe / the
`Proposal` type); optional hooks a proposer may have: `observe_copies` / `observe_drafter` /
`propose_copies` (a grafted lookup, fed apart), `observe_step_time` (measured forward and acceptance seconds per
batch and verify length), `block_size` (a block drafter: it drafts every row in one forward), and
`begin_request(sampling, seeded_sampling)` (called by `generate` after `reset`: the request's sampling
settings and what its seed drives).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from specrt.runtime.proposers.backlog import DrafterBacklog
from specrt.runtime.proposers.base import Proposal, coupled
from specrt.runtime.sampling import SamplingParams, next_token, probabilities
from specrt.runtime.seeded import GREEDY_DRAFTS, DraftNoise, accept_seeded, seeded_token
from specrt.runtime.stats import RequestStats
from specrt.runtime.tree import kv_keep_indices, tree_attention_mask, tree_positions
from specrt.runtime.verify import (
    row_argmax,
    verify_chain_greedy,
    verify_chain_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)

EMPTY = Proposal.chain(torch.zeros(0, dtype=torch.long))
DRAFTS = ("drafter", "copies", "none")  # what a step verifies (module docstring, "draft")
SEEDED_SAMPLING = ("noise", "stream")  # what a seed drives: the seeded rule, or rejection sampling's coins


@dataclass
class TokenRule:
    """How one request picks its tokens: greedy, seeded (Gumbel-max) or sampled (rejection sampling)."""

    sampling: SamplingParams
    generator: torch.Generator | None = None  # sampled: the coins of rejection sampling
    seeded: bool = False  # seeded: Gumbel-max on noise keyed by (sampling.seed, token index)

    @classmethod
    def of(cls, sampling: SamplingParams, seeded_sampling: str = "noise",
           generator: torch.Generator | None = None) -> TokenRule:
        """The rule of a request: greedy at temperature 0; seeded when it has a seed and
        seeded_sampling is "noise"; else rejection sampling with `generator` (default: one from the seed)."""
        if sampling.greedy:
            return cls(sampling)
        if sampling.seed is not None and seeded_sampling == "noise":
            return cls(sampling, seeded=True)
        return cls(sampling, generator if generator is not None else sampling.generator())

    @property
    def draft_sampling(self) -> SamplingParams:
        """What the proposer drafts with: greedy for a seeded row (on the noise of `draft_noise`, where
        the proposer couples it)."""
        return GREEDY_DRAFTS if self.seeded else self.sampling

    def draft_noise(self, generated: int) -> DraftNoise | None:
        """A seeded row's coupling for drafts after the token at generated index `generated` - 1."""
        return DraftNoise(self.sampling, generated) if self.seeded else None

    def first(self, logits: torch.Tensor) -> int:
        """The first generated token (index 0) from the prompt's last logits [V]."""
        if self.seeded:
            return seeded_token(logits, self.sampling, 0)
        return int(next_token(logits, self.sampling, self.generator))

    def accept(self, p: Proposal, logits: torch.Tensor, index: int) -> tuple[list[int], int]:
        """Accepted path (node indices) and the token after it, for one row.

        logits [>= N+1, V]: row 0 follows the anchor, row i+1 node i; `index` is the generated index
        of the token after the anchor (the seeded rule's noise key)."""
        rows = logits[: len(p) + 1]
        if not p.tokens.shape[0] and self.sampling.greedy:  # a plain greedy step: the argmax alone
            return [], row_argmax(rows)[0]
        if self.seeded:
            return accept_seeded(p, rows, self.sampling, index)
        if self.sampling.greedy:
            if p.is_chain:
                k, bonus = verify_chain_greedy(p.tokens, rows)
                return list(range(k)), bonus
            return verify_tree_greedy(p.tokens, p.parents, rows)
        if len(p) == 0:  # nothing to verify: a sample of p itself (one multinomial, as plain decoding draws it)
            return [], int(next_token(rows[0], self.sampling, self.generator))
        target_probs = probabilities(rows, self.sampling)
        if p.is_chain:
            k, bonus = verify_chain_sampling(p.tokens, p.draft_probs, target_probs, self.generator)
            return list(range(k)), bonus
        return verify_tree_sampling(p.tokens, p.parents, target_probs, p.draft_probs, self.generator)


@dataclass
class StepRow:
    """One request row in a step. The step moves `anchor` and `generated` on as it emits."""

    row: int  # the engine row
    anchor: int  # the last emitted token, not yet in the cache
    rule: TokenRule
    generated: int  # tokens emitted so far: the generated index of the token after the anchor
    stats: RequestStats  # rounds, acceptance and time are recorded here; tokens by the caller's emit


@dataclass
class StepReport:
    proposed: int = 0  # drafts after the cache cut, before the caller's plan
    verified: int = 0  # drafts sent to verification
    accepted: int = 0  # drafts accepted
    emitted: int = 0  # accepted + bonus tokens handed to emit (before its stop conditions)
    positions: int = 0  # token positions the forward computed (engine rows x padded length)
    draft_seconds: float = 0.0  # drafting (and ingesting before it)
    verify_seconds: float = 0.0  # the verify forward and the acceptance (what the step cost measures)
    seconds: float = 0.0  # the whole step


Emit = Callable[[StepRow, list[int]], bool]  # (row, accepted + bonus) -> True while the row goes on
Plan = Callable[[list[Proposal], float], list[Proposal]]  # (cut proposals, draft seconds) -> verified ones
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int]], tuple]  # (ids, pos, mask, sizes)


def room_cut(p: Proposal, engine, row: int) -> Proposal:
    """p cut to the row's free cache slots (the anchor and every verified draft need one)."""
    return p.truncated(max(engine.capacity - 1 - int(engine.lengths[row]), 0))


def verify_batch(proposals: list[Proposal | None], anchors: list[int], lengths: torch.Tensor):
    """ids, positions [B, T] and new_mask [B, T, T] for [anchor, drafts...] of each row (None: a dummy)."""
    batch = len(proposals)
    sizes = [len(p) if p is not None else 0 for p in proposals]
    t = 1 + max(sizes)
    ids = torch.tensor(anchors, dtype=torch.long)[:, None]
    positions = lengths[:, None].expand(batch, t).clone()
    if t == 1:  # a plain step: each row's anchor alone (kept lean: plain decoding runs this every token)
        return ids, positions, torch.ones(batch, 1, 1, dtype=torch.bool)
    ids = torch.cat([ids, ids.new_zeros(batch, t - 1)], dim=1)
    mask = torch.eye(t, dtype=torch.bool).expand(batch, t, t).clone()  # padding sees only itself
    for b, (p, n) in enumerate(zip(proposals, sizes)):
        if n == 0:
            continue
        base = int(lengths[b])
        ids[b, 1:n + 1] = p.tokens
        positions[b, : n + 1] = tree_positions(p.parents, base, with_root=True)
        mask[b, : n + 1, : n + 1] = tree_attention_mask(p.parents, with_root=True)
    return ids, positions, mask


class DecodeStep:
    """The step of the module docstring, over one proposer (or none) and the engines its caller hands it.

    lazy: hold committed tokens until the next drafting step (the serving draft gate); else the
    proposer ingests them at the end of every step. draft_generator: the coins sampled drafts are
    drawn with. step_times: report each verify (forward and acceptance) seconds to a proposer with `observe_step_time`
    (off where a scheduler sizes the verify step itself).
    """

    def __init__(self, proposer=None, lazy: bool = False, draft_generator: torch.Generator | None = None,
                 step_times: bool = True) -> None:
        self.proposer = proposer
        self.lazy = lazy
        self.draft_generator = draft_generator
        self.step_times = step_times
        # a lookup grafted onto a drafter (`WithLookup`) is fed every step, the drafter when it drafts
        self.split = hasattr(proposer, "observe_copies")
        self.pending = DrafterBacklog()  # lazy: what the rows committed and the proposer has not ingested

    def forget(self, row: int) -> None:
        """A row left: drop what it committed and the proposer has not seen."""
        self.pending.drop(row)

    def forget_all(self) -> None:
        self.pending.drop()

    def __call__(self, engine, rows: list[StepRow], emit: Emit, *, proposer=None, drafts: str = "drafter",
                 plan: Plan | None = None, forward: Forward | None = None, hold: list | None = None) -> StepReport:
        """One step over `rows` (ascending engine rows) of `engine` (or a plain run, below).

        proposer: the proposer to use this step (a row view of the step's own; default: it).
        drafts: "drafter", "copies" or "none" (module docstring). plan: cuts the proposals further.
        forward: runs the verify forward instead of `engine.forward` (gets each engine row's real size).
        hold: collect what the step committed here instead of handing it to the proposer, and leave
        the step time to the caller (`_plain_run`).

        Plain runs: a proposer with `plain_run` (`--drafter auto`, a named drafter that sits out) may
        hand over its next rounds of a lone sampled row as plain steps in one go; they then run here
        with no proposer work between them, and it ingests their tokens in one call at the end.
        """
        if drafts not in DRAFTS:
            raise ValueError(f"drafts must be one of {DRAFTS}, got {drafts!r}")
        proposer = proposer if proposer is not None else self.proposer
        if (hold is None and drafts == "drafter" and plan is None and forward is None and len(rows) == 1
                and not self.lazy):
            plain_run = getattr(proposer, "plain_run", None)
            rounds = plain_run(rows[0].rule.sampling) if plain_run is not None else 0
            if rounds:
                return self._plain_run(engine, rows, emit, proposer, rounds)
        report = StepReport()
        t0 = time.perf_counter()
        drafted = self._draft(proposer, rows, drafts if proposer is not None else "none")
        t_drafted = time.perf_counter()
        report.draft_seconds = t_drafted - t0
        proposals: list[Proposal | None] = [None] * int(engine.batch_size)
        if drafted is None:
            for r in rows:
                proposals[r.row] = EMPTY
        else:
            cut = [room_cut(p, engine, r.row) for p, r in zip(drafted, rows)]
            report.proposed = sum(len(p) for p in cut)
            if plan is not None:
                cut = plan(cut, report.draft_seconds)
            for r, p in zip(rows, cut):
                proposals[r.row] = p if len(p) else EMPTY
        t1 = time.perf_counter()
        # a lone row with nothing to verify (plain decoding, a proposer's plain round): the engine's
        # one-token call, committed by the engine (nothing else to build)
        decode_one = getattr(engine, "decode_one", None) if forward is None and len(rows) == 1 else None
        lean = None
        greedy_token = None  # a greedy lean step's argmax, taken by the engine: no logits in torch
        if decode_one is not None and (drafted is None or not len(proposals[rows[0].row])):
            greedy = rows[0].rule.sampling.greedy
            lean = decode_one(rows[0].anchor, greedy)
            if lean is not None and greedy:  # the engine handed back the argmax in place of the logits
                greedy_token, lean = lean[0], (None, lean[1])
        if lean is not None:
            logits, taps = lean
            shape = (1, 1)
        else:
            anchors = [0] * len(proposals)
            for r in rows:
                anchors[r.row] = r.anchor
            ids, positions, mask = verify_batch(proposals, anchors, engine.lengths)
            if forward is not None:
                logits, taps = forward(ids, positions, mask, [1 + len(p) if p is not None else 1 for p in proposals])
            else:
                logits, taps = engine.forward(ids, positions, mask)
            shape = tuple(ids.shape)
        t2 = time.perf_counter()
        report.positions = shape[0] * shape[1]
        accepting = 0.0  # seconds spent choosing the tokens: part of what a verified row costs
        committed = []  # (row, tokens the target kept, their taps, the next anchor) of rows that go on
        for r in rows:
            p = proposals[r.row]
            t_accept = time.perf_counter()
            if greedy_token is not None:
                path, bonus = [], greedy_token
            else:
                path, bonus = r.rule.accept(p, logits[r.row], r.generated)
            accepting += time.perf_counter() - t_accept
            keep = kv_keep_indices(path)
            if lean is None:
                engine.commit(r.row, keep)
            accepted = [int(p.tokens[i]) for i in path]
            r.stats.rounds += 1
            r.stats.record_acceptance(p.depth, len(path))
            report.verified += 0 if drafted is None else len(p)  # plain: no torch op on the lean path
            report.accepted += len(path)
            report.emitted += len(path) + 1
            previous = r.anchor
            r.anchor, r.generated = bonus, r.generated + len(path) + 1
            if emit(r, accepted + [bonus]) and proposer is not None:
                row_taps = None
                if taps is not None:  # a chain keeps a contiguous range: slice it (cheaper than a gather)
                    contiguous = keep[-1] - keep[0] + 1 == len(keep)
                    row_taps = taps[r.row, keep[0]:keep[-1] + 1] if contiguous else taps[r.row, keep]
                committed.append((r.row, [previous] + accepted, row_taps, bonus))
        t3 = time.perf_counter()
        # a verify step's cost: the forward and the acceptance, which reads every verified row (a
        # sampled row draws noise or probabilities per row: host time that grows with the step)
        report.verify_seconds = t2 - t1 + accepting
        if hold is not None:
            hold.extend(committed)
            committed = []
        timer = getattr(proposer, "observe_step_time", None) if self.step_times and hold is None else None
        if timer is not None:
            timer(shape[0], shape[1], report.verify_seconds)
        if committed:
            self._ingest(proposer, committed)
        t4 = time.perf_counter()
        report.seconds = t4 - t0
        for r in rows:
            r.stats.draft_seconds += report.draft_seconds + (t4 - t3)
            r.stats.verify_seconds += t2 - t1
            r.stats.host_seconds += (t1 - t_drafted) + (t3 - t2)
        return report

    def _plain_run(self, engine, rows: list[StepRow], emit: Emit, proposer, rounds: int) -> StepReport:
        """Up to `rounds` plain steps of the lone row (`__call__`, plain runs), then one ingest of all
        they committed and one verify time (their mean) for the proposer's step cost.

        Why: a proposer's bookkeeping between plain steps (the copy lookup, the arm choice, the
        drafter's backlog, the step cost: ~0.14 ms of calls a round, and the cache misses they cause)
        costs a small model's CPU step ~5% (int4 SmolLM2, temperature 1, 10 MT-bench prompts,
        interleaved: `--drafter auto` 0.94x of plain decoding round by round, 0.99x with runs), and
        a round already decided to run plain needs none of it. The tokens and taps are the same ones
        k single ingests would hand over (one batched observe of k steps equals k observes, `flush`),
        so drafting after the run is unchanged; the steps are plain steps, so the text is plain
        decoding's."""
        held: list = []
        total = StepReport()
        steps = 0
        for _ in range(rounds):
            before = len(held)
            report = self(engine, rows, emit, proposer=proposer, drafts="none", hold=held)
            steps += 1
            for name in ("emitted", "positions", "verify_seconds", "seconds"):
                setattr(total, name, getattr(total, name) + getattr(report, name))
            if len(held) == before:  # the row stopped (eos, length, a full cache)
                break
        t0 = time.perf_counter()
        timer = getattr(proposer, "observe_step_time", None) if self.step_times else None
        if timer is not None:
            timer(1, 1, total.verify_seconds / steps)
        if held:
            taps = [h[2] for h in held]
            joined = (held[0][0], [t for h in held for t in h[1]],
                      None if taps[0] is None else torch.cat(taps), held[-1][3])
            self._ingest(proposer, [joined])
        seconds = time.perf_counter() - t0
        rows[0].stats.draft_seconds += seconds
        total.draft_seconds, total.seconds = seconds, total.seconds + seconds
        return total

    # ------------------------------------------------------------------------------ draft / ingest
    def _draft(self, proposer, rows: list[StepRow], drafts: str) -> list[Proposal] | None:
        """One proposal per row, or None for a plain step."""
        if drafts == "none":
            return None
        if drafts == "copies":  # the grafted lookup alone: no drafter forward
            return list(proposer.propose_copies([r.row for r in rows]))
        if self.lazy:
            self.flush(proposer)
        groups: dict[object, list[StepRow]] = {}  # rows by draft settings (the seed does not change drafts)
        for r in rows:
            s = r.rule.draft_sampling
            groups.setdefault(s.distribution, []).append(r)
        # a block drafter writes scratch K/V for every row it is not asked about (at position 0):
        # with several groups, each call drafts all the step's rows and keeps its own group's
        all_rows = len(groups) > 1 and hasattr(proposer, "block_size")
        coupling = getattr(proposer, "couples_noise", False)
        out: dict[int, Proposal] = {}
        for group in groups.values():
            sampling = group[0].rule.draft_sampling
            call = rows if all_rows else group
            noise = None
            if coupling and any(r.rule.seeded for r in group):
                members = {id(r) for r in group}
                noise = [r.rule.draft_noise(r.generated) if id(r) in members else None for r in call]
            drafted = proposer.propose([r.row for r in call], [r.anchor for r in call], sampling,
                                       None if sampling.greedy else self.draft_generator, **coupled(noise))
            wanted = {r.row for r in group}
            out.update({r.row: p for r, p in zip(call, drafted) if r.row in wanted})
        return [out[r.row] for r in rows]

    def _ingest(self, proposer, committed) -> None:
        if self.split:  # copies need every committed token before the next copy: now
            proposer.observe_copies([c[0] for c in committed], [c[1] for c in committed], [c[3] for c in committed])
        if self.lazy:
            self.pending.hold(*zip(*committed))
        else:
            (proposer.observe_drafter if self.split else proposer.observe)(*map(list, zip(*committed)))

    def flush(self, proposer) -> None:
        """Hand the proposer what the target committed since its last ingest, all rows in one call.

        One batched observe of k steps' tokens equals k observes (context entries are per
        position; EAGLE-3's rows are causal), so a lazy proposer pays nothing on plain steps.
        """
        self.pending.catch_up(proposer.observe_drafter if self.split else proposer.observe)
