"""Continuous batching: requests join and leave a fixed set of KV rows between steps.

One `Batcher` owns one target engine with B rows (slots) and, optionally, a proposer over the same
rows. It is single-threaded: `specrt.runtime.serving.loop.EngineLoop` runs it in the background
thread of a server; tests and the bench can call `step()` directly.

A step (`step()`):
  1. reap   cancelled requests finish; their rows are freed (length 0, so they stop widening the
            attention window) and reused by the next admission;
  2. admit  waiting requests take the lowest free rows (so busy rows stay packed at the bottom);
  3. prefill the new requests, batched per run of consecutive rows, as its own engine call over
            a row view of the engine (`rows.row_view`): running rows are not touched; each new
            request's first token comes from its own sampling settings and generator, and the
            proposer ingests its prompt;
  4. decode  every running request (the new ones included) in one step of
            `specrt.runtime.step.DecodeStep` (the step `generate` runs too) over rows 0..hi-1
            (hi = highest busy row + 1): draft (grouped by sampling settings), choose the verify
            lengths (`policy`: fixed or Algorithm 1, the step's plan), verify, commit, emit, observe.
Plain decoding is the same step with empty proposals (no proposer, the draft gate closed, or, in
the scheduled mode, the measured gate finding speculative steps slower than plain ones at this
many requests: `measured_gate.MeasuredGate`).
With copies grafted on (`WithLookup`), a closed gate shuts the drafter's forward only: the copies
(no forward to pay) are still proposed and scheduled ("copy-only steps"); the lookup is fed every
step, the drafter lazily before its next draft.

Lossless under batching: a row sees only its own committed slots and its own new tokens (the
engine's mask), padding is never committed, and verification is per row with the request's own
sampling settings, so a request's greedy output is its output alone. Sampled outputs have exactly
the target's distribution. A request with a seed is reproducible: with `seeded_sampling="noise"`
(the default) its tokens are Gumbel-max picks from noise keyed by (seed, token index)
(`specrt.runtime.seeded`), so its text is the same alone or batched, with or without drafts,
whatever the scheduler and the draft gate decide, and the same as `specrt generate` with that seed;
it drafts greedily and verifies on the perturbed scores. `seeded_sampling="stream"` starts
rejection sampling's generator from the seed instead:
higher acceptance, but reproducible only for the same batch history (drafts share one random
stream across requests, and the verify lengths depend on the batch and on measured step times).
Requests without a seed always use rejection sampling.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from specrt.plugins.errors import SpecrtError
from specrt.runtime.engine import causal_mask
from specrt.runtime.generate import prefill
from specrt.runtime.proposers.base import Proposal
from specrt.runtime.proposers.lookup import copy_proposal
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.seeded import is_seeded
from specrt.runtime.serving.measured_gate import MeasuredGate
from specrt.runtime.serving.policy import SCHEDULES, DraftGate, apply_schedule
from specrt.runtime.serving.rows import (
    forward_active_runs,
    proposer_prefix_view,
    reset_engine_row,
    reset_proposer_row,
    row_view,
    runs,
    supports_views,
)
from specrt.runtime.stats import RequestStats
from specrt.runtime.step import SEEDED_SAMPLING, DecodeStep, StepRow, TokenRule, room_cut

log = logging.getLogger("specrt.serving")
_ids = itertools.count(1)


@dataclass(eq=False)
class Request:
    """One generation request. The batcher fills the fields below the line."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    on_tokens: Callable[[Request, list[int]], None] | None = None  # engine thread: keep it short
    on_finish: Callable[[Request], None] | None = None
    # ---- filled by the batcher
    id: int = field(default_factory=lambda: next(_ids))
    row: int | None = None
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    finish_reason: str | None = None  # eos | length | cache_full | cancelled | error
    error: str | None = None
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    anchor: int = -1
    generator: torch.Generator | None = None  # rejection sampling's coins (unseeded or "stream" requests)
    noise: bool = False  # seeded: Gumbel-max on (seed, index)-keyed noise (specrt.runtime.seeded)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BatcherCounters:
    steps: int = 0  # decode steps (one target forward each)
    draft_steps: int = 0  # steps that ran the drafter
    prefill_calls: int = 0
    prefill_tokens: int = 0
    step_tokens: int = 0  # token positions the decode steps computed (rows x padded length)
    proposed_drafts: int = 0  # drafts the proposer made (before the schedule cut them)
    verify_drafts: int = 0  # drafts sent to verification
    accepted_drafts: int = 0
    emitted: int = 0  # tokens emitted by decode steps (tau's numerator)
    row_steps: int = 0  # sum over decode steps of running requests (tau's denominator)
    finished: int = 0
    generated: int = 0  # every token handed to a request (prefill's first tokens included)
    copy_steps: int = 0  # steps that verified copies from the text with the drafter gated off
    measured_plain_steps: int = 0  # steps the measured gate ran plain (speculation measured slower, or a probe)
    busy_seconds: float = 0.0
    finish_reasons: dict = field(default_factory=dict)  # reason -> count
    peak_running: int = 0  # most requests decoded together so far


class Batcher:
    """Continuous batching over one engine (module docstring)."""

    def __init__(self, engine, proposer=None, schedule: str = "fixed", sps=None, eos_token_ids=(),
                 cost: str | None = None, draft_gate: bool = True, draft_seed: int = 0,
                 seeded_sampling: str = "noise", measured_gate: bool = True) -> None:
        if schedule not in SCHEDULES:
            raise SpecrtError(f"unknown schedule {schedule!r}", f"use one of {', '.join(SCHEDULES)}")
        if schedule == "confidence" and proposer is not None and sps is None:
            raise SpecrtError("confidence scheduling needs an SPS table (target steps/s vs verify tokens)",
                              "run `specrt calibrate` for this engine, or use --schedule fixed")
        if seeded_sampling not in SEEDED_SAMPLING:
            raise SpecrtError(f"unknown seeded_sampling {seeded_sampling!r}", f"use one of {', '.join(SEEDED_SAMPLING)}")
        self.seed_noise = seeded_sampling == "noise"
        self.engine, self.proposer = engine, proposer
        # an engine that runs each row of a batch as its own call on its real tokens
        # (`OrtTargetModel.per_row_batches`): idle rows are skipped, not computed as padding
        self.per_row = bool(getattr(getattr(engine, "model", None), "per_row_batches", False))
        if cost is None:
            # a step's cost model (`policy`): rows padded to the longest, or, on a per-row engine,
            # the paper's packed count of verify tokens, which is what its steps cost
            cost = "packed" if self.per_row else "padded"
        self.schedule, self.sps, self.cost = schedule, sps, cost
        self.slots = int(engine.batch_size)
        self.capacity = int(engine.capacity)
        self.eos = frozenset(int(t) for t in eos_token_ids)
        if proposer is not None:
            need = proposer.max_drafts + 1
            if getattr(engine, "spare_slots", need) < need:
                raise SpecrtError(f"the engine has {engine.spare_slots} spare cache slots, the {proposer.name} "
                                  f"drafter verifies up to {need} tokens per step",
                                  "build the engine with spare_slots >= the drafter's verify size")
        self.taps = tuple(proposer.tap_layers) if proposer is not None else ()
        engine.set_taps(self.taps)
        engine.reset(self.slots)
        if proposer is not None:
            proposer.reset(self.slots, self.capacity)
        self.views = supports_views(engine)
        # copies from the text (`proposers.lookup`) cost no forward: a WithLookup proposer is fed
        # apart (copies every step, the drafter lazily) so the gate can shut the drafter alone
        self.split = hasattr(proposer, "observe_copies")
        gated = proposer is not None and not getattr(proposer, "free_drafts", False)
        self.gate = DraftGate() if (draft_gate and schedule == "confidence" and gated) else None
        # predictions can be wrong where measurements are not: the scheduled mode also checks that
        # speculative steps really outrun plain ones (`measured_gate`); the fixed mode always speculates
        scheduled = schedule == "confidence" and proposer is not None
        self.measured = MeasuredGate() if (measured_gate and scheduled) else None
        # the shared decoding step; with a draft gate the drafter ingests lazily, before it drafts.
        # Step times are not reported to the proposer: the schedule (`policy`) sizes verify steps here
        self.decode_step = DecodeStep(proposer, lazy=self.gate is not None,
                                      draft_generator=torch.Generator().manual_seed(int(draft_seed)), step_times=False)
        self.free: list[int] = list(range(self.slots))
        self.running: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.counters = BatcherCounters()
        self.last_schedule = None

    # ---------------------------------------------------------------- requests
    def validate(self, req: Request) -> None:
        """Refuse what cannot be generated (SpecrtError names the problem and the fix)."""
        if req.max_tokens < 1:
            raise SpecrtError(f"max_tokens must be >= 1, got {req.max_tokens}", "ask for at least one token")
        if not req.prompt:
            raise SpecrtError("empty prompt", "give at least one token of prompt text")
        if len(req.prompt) >= self.capacity:
            raise SpecrtError(f"the prompt has {len(req.prompt)} tokens but the KV cache holds {self.capacity} "
                              "(one slot must stay free to generate)", "shorten the prompt or raise --capacity")
        vocab = self.engine.config.vocab_size
        bad = [t for t in req.prompt if not 0 <= int(t) < vocab]
        if bad:
            raise SpecrtError(f"token id {bad[0]} is outside the vocabulary (size {vocab})",
                              "encode the prompt with the model's own tokenizer")

    def add(self, req: Request) -> Request:
        self.validate(req)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Mark for cancellation; the next step finishes it and frees its row."""
        req.cancelled = True

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def free_rows(self) -> int:
        return len(self.free)

    # ---------------------------------------------------------------- the step
    def step(self) -> bool:
        """One scheduler iteration; False when there was nothing to do."""
        start = time.perf_counter()
        self._reap()
        new = self._admit()
        if new or self.running:
            self.engine.set_taps(self.taps)  # the model may be shared with another engine (bench, tests)
        if new:
            self._prefill(new)
        active = sorted(self.running)
        if active:
            self._decode(active)
        if new or active:
            self.counters.busy_seconds += time.perf_counter() - start
            return True
        return False

    def run_until_done(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise RuntimeError("run_until_done: step limit reached")

    def fail_all(self, message: str) -> None:
        """Finish every request with an error (after an engine failure) and start clean."""
        for req in list(self.running.values()) + list(self.waiting):
            req.error = message
            self._finish(req, "error")
        self.waiting.clear()
        self.decode_step.forget_all()
        self.engine.reset(self.slots)
        if self.proposer is not None:
            self.proposer.reset(self.slots, self.capacity)

    # ---------------------------------------------------------------- internals
    def _reap(self) -> None:
        for req in [r for r in self.running.values() if r.cancelled]:
            self._finish(req, "cancelled")
        if any(r.cancelled for r in self.waiting):
            kept = deque()
            for req in self.waiting:
                if req.cancelled:
                    self._finish(req, "cancelled")
                else:
                    kept.append(req)
            self.waiting = kept

    def _admit(self) -> list[Request]:
        new = []
        while self.free and self.waiting:
            req = self.waiting.popleft()
            row = self.free.pop(0)
            req.row, req.started_at = row, time.perf_counter()
            req.stats = RequestStats(prompt_tokens=len(req.prompt))
            req.noise = self.seed_noise and is_seeded(req.sampling)
            req.generator = None if (req.sampling.greedy or req.noise) else req.sampling.generator()
            reset_engine_row(self.engine, row)
            reset_proposer_row(self.proposer, row)
            self.running[row] = req
            new.append(req)
        self.counters.peak_running = max(self.counters.peak_running, len(self.running))
        return new

    def _finish(self, req: Request, reason: str) -> None:
        if req.done:
            return
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        req.stats.finish_reason = reason
        req.stats.round_tokens = max(req.stats.new_tokens - 1, 0)
        if req.row is not None and self.running.get(req.row) is req:
            del self.running[req.row]
            self.decode_step.forget(req.row)
            reset_engine_row(self.engine, req.row)  # idle rows must not widen the attention window
            bisect.insort(self.free, req.row)
        self.counters.finished += 1
        self.counters.finish_reasons[reason] = self.counters.finish_reasons.get(reason, 0) + 1
        if req.on_finish is not None:
            try:
                req.on_finish(req)
            except Exception:  # a client's callback must never stop the engine
                log.exception("on_finish callback of request %s failed", req.id)

    def _emit(self, req: Request, tokens: list[int]) -> None:
        """Append tokens, stopping at eos / stop ids / max_tokens / a full cache."""
        taken, reason = [], None
        for tok in tokens:
            taken.append(tok)
            if (tok in self.eos and not req.ignore_eos) or tok in req.stop_token_ids:
                reason = "eos"
                break
            if len(req.tokens) + len(taken) >= req.max_tokens:
                reason = "length"
                break
        if req.first_token_at is None and taken:
            req.first_token_at = time.perf_counter()
        req.tokens.extend(taken)
        req.stats.new_tokens += len(taken)
        self.counters.generated += len(taken)
        if reason is None and int(self.engine.lengths[req.row]) + 1 >= self.capacity:
            reason = "cache_full"
        if taken and req.on_tokens is not None:
            try:
                req.on_tokens(req, taken)
            except Exception:
                log.exception("on_tokens callback of request %s failed", req.id)
        if reason is not None:
            self._finish(req, reason)

    def _prefill(self, new: list[Request]) -> None:
        start = time.perf_counter()
        groups = []  # (requests, logits [n, V], taps [n, T, ...] | None)
        if self.views:
            for lo, hi in runs([r.row for r in new]):
                group = [self.running[row] for row in range(lo, hi)]
                logits, taps = prefill(row_view(self.engine, lo, hi), [r.prompt for r in group])
                groups.append((group, logits, taps))
        else:
            groups.append(self._prefill_whole_batch(new))
        self.counters.prefill_calls += len(groups)
        self.counters.prefill_tokens += sum(len(r.prompt) for r in new)
        rows, prompts, taps_rows, firsts = [], [], [], []
        for group, logits, taps in groups:
            for i, req in enumerate(group):
                first = self._rule(req).first(logits[i])
                req.anchor = first
                rows.append(req.row)
                prompts.append(list(req.prompt))
                taps_rows.append(None if taps is None else taps[i if self.views else req.row, : len(req.prompt)])
                firsts.append(first)
        if self.proposer is not None:
            self.proposer.observe(rows, prompts, taps_rows, firsts)
        seconds = time.perf_counter() - start
        for group, _, _ in groups:
            for req in group:
                req.stats.prefill_seconds = seconds
                self._emit(req, [req.anchor])

    def _prefill_whole_batch(self, new: list[Request]):
        """Fallback for engines without row views: one forward over all rows, others as padding."""
        engine, batch = self.engine, self.slots
        longest = max(len(r.prompt) for r in new)
        ids = torch.zeros(batch, longest, dtype=torch.long)
        positions = engine.lengths.clone()[:, None] + torch.arange(longest)[None, :]
        valid = [0] * batch
        last = torch.zeros(batch, 1, dtype=torch.long)
        for req in new:
            n = len(req.prompt)
            ids[req.row, :n] = torch.tensor(req.prompt)
            positions[req.row] = torch.arange(longest)
            valid[req.row] = n
            last[req.row, 0] = n - 1
        logits, taps = engine.forward(ids, positions, causal_mask(batch, longest, valid), last)
        for req in new:
            engine.commit(req.row, range(len(req.prompt)))
        logits = logits[:, 0]
        return new, torch.stack([logits[r.row] for r in new]), taps

    @contextlib.contextmanager
    def _full_drafts(self, proposer):
        """Confidence mode: the scheduler, not DSpark's fixed threshold, decides how much to verify."""
        if self.schedule != "confidence":
            yield
            return
        # the drafter's confidence cut and the lookup's survival cut both give way to Algorithm 1
        holders = [h for h in (proposer, getattr(proposer, "lookup", None)) if h is not None and hasattr(h, "threshold")]
        saved = [h.threshold for h in holders]
        for h in holders:
            h.threshold = 0.0
        try:
            yield
        finally:
            for h, value in zip(holders, saved):
                h.threshold = value

    @staticmethod
    def _rule(req: Request) -> TokenRule:
        return TokenRule(req.sampling, req.generator, req.noise)

    def _judge_drafter(self, pview, view, active: list[int], hi: int, plan, draft_seconds: float) -> None:
        """Tell the gate whether this drafting step paid: the scheduler's predicted tokens/s with the
        drafting time included, against the better of plain decoding and the copies alone (what the
        step would have verified with the drafter shut; `policy.DraftGate`)."""
        predicted = plan.tau / (draft_seconds + 1.0 / float(self.sps(plan.tokens)))
        without = plan.baseline
        chains = getattr(pview, "last_chains", None)
        if chains is not None and all(r in chains for r in active):
            copies = [room_cut(copy_proposal(chains[r]), view, r) for r in active]
            _, copies_plan = apply_schedule(copies, self.sps, hi, self.cost)
            without = max(without, copies_plan.throughput)
        plain_step = len(active) / plan.baseline  # seconds of a plain step of these rows
        self.gate.record(predicted, without, draft_seconds / plain_step)

    def _decode(self, active: list[int]) -> None:
        c = self.counters
        reqs = {row: self.running[row] for row in active}
        hi = active[-1] + 1 if self.views else self.slots
        view = row_view(self.engine, 0, hi) if self.views else self.engine
        pview = proposer_prefix_view(self.proposer, hi)
        speculate = self.measured is None or self.measured.speculate(len(active))
        if not speculate:
            c.measured_plain_steps += 1
        drafting = speculate and self.proposer is not None and (self.gate is None or self.gate.should_draft())
        copying = speculate and not drafting and self.split  # the gate shut the drafter; copies cost nothing to make
        drafts = "drafter" if drafting else "copies" if copying else "none"
        plan = None
        if self.schedule == "confidence" and drafts != "none":
            def plan(cut: list[Proposal], draft_seconds: float) -> list[Proposal]:
                cut, self.last_schedule = apply_schedule(cut, self.sps, hi, self.cost)
                if self.gate is not None and drafting:
                    self._judge_drafter(pview, view, active, hi, self.last_schedule, draft_seconds)
                return cut
        forward = None
        if self.per_row and self.views and len(active) < hi:
            # one call per row: rows left idle inside the range would each cost a one-token call
            def forward(ids, positions, mask, sizes):
                return forward_active_runs(self.engine, ids, positions, mask, active, sizes)

        def emit(row: StepRow, tokens: list[int]) -> bool:
            req = reqs[row.row]
            req.anchor = row.anchor
            self._emit(req, tokens)
            return not req.done

        rows = [StepRow(row, reqs[row].anchor, self._rule(reqs[row]), len(reqs[row].tokens), reqs[row].stats)
                for row in active]
        with self._full_drafts(pview):
            report = self.decode_step(view, rows, emit, proposer=pview, drafts=drafts, plan=plan, forward=forward)
        if drafting:
            c.draft_steps += 1
        elif copying:
            c.copy_steps += 1
        c.steps += 1
        c.step_tokens += report.positions
        c.row_steps += len(active)
        c.proposed_drafts += report.proposed
        c.verify_drafts += report.verified
        c.accepted_drafts += report.accepted
        c.emitted += report.emitted
        if self.measured is not None:
            self.measured.record(len(active), report.verified > 0, report.emitted, report.seconds)
