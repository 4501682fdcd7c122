"""`--drafter auto`: each round, the way of drafting that measured the most tokens per second so far in
this request (plain steps, copies, or the drafter with copies grafted on).

Why. Which proposer pays depends on the device, the weights and the text (DESIGN.md section 5). On
a CPU every verified row costs: copies from the text pay where the text repeats itself, a drafter
pays where it was trained and costs a forward pass every round, and where neither lands a plain
step is the fastest. No fixed choice is right for every request, so the choice is measured.

Arms (each one way to fill a round):
  plain    no drafts: the round verifies the anchor alone (an empty proposal). A round chosen to
           run plain runs the copies instead where their own rule says one pays (`_paying_copies`)
  copies   drafts copied from the request's text and the folder's datastore (`LookupProposer`)
  drafter  the folder's drafter, copies grafted on (`WithLookup`), where the folder has a drafter
A round's cost is the wall time from one `propose` call to the next: drafting, the verify forward,
acceptance and every bit of host work the round made the loop do. Its yield is the tokens the
target committed in it (anchor + accepted drafts = the tokens the round emitted). Per arm, tokens
and seconds are decayed sums (decay per sample of that arm), so a rate is tokens / seconds and a run
of cheap one-token rounds cannot outvote fewer long accepted chains.

Choice (`_choose`, a few dict reads per round: a small CPU model's plain step is ~7-10 ms):
  - warm-up: each arm runs `warmup` rounds (copies, then the drafter, then plain);
  - then the arm with the best rate runs, each arm's rate bounded by what its rounds commit against
    plain rounds (`estimate`: drafts cost a plain round and more, so only accepted drafts can put an
    arm ahead of plain; ties go to plain); every `probe_every` rounds the other arm that ran least
    recently runs once, so its estimate follows the text and the load. While probes confirm the
    leader the interval doubles up to `max_probe`; when the leader changes it restarts at
    `first_probe`. A probe of a slower arm costs at most one round of that arm per `probe_every`
    rounds of the leader (1/64 of the rounds once settled).
  - estimates carry over to the next request of the same pipeline with their weight cut to `carry`:
    a request starts from what the last one measured (no second warm-up) and probes early.
  - plain runs (`plain_run`): while plain leads a sampled request, the rounds up to the next probe
    run as plain steps in one go, with no lookup, choice or ingest between them (one ingest at the
    end): on a CPU that bookkeeping costs ~5% of a small model's step (`DecodeStep._plain_run`).

A named drafter (`pinned`): the user's choice runs every round except probes of the other arms
(after `pinned_first_probe` rounds, then doubling up to `pinned_max_probe`, i.e. 1 round in 32 once
settled; a plain or copies probe costs about one plain round). The probes measure what the
automatic choice would have delivered, and `slower_note()` says so when the named drafter was
slower on the request. Without the probes there would be nothing to compare with. One exception
keeps a named drafter from ever being the slow choice: while plain rounds measure more tokens per
second than the drafter's (text or sampling settings where its drafts rarely land, e.g. temperature
1), the rounds run plain (`dormant`), verifying the copies that pay by their own rule, and the
probes keep running the drafter, which takes over again as soon as it measures faster.

Lossless. Every arm's drafts are verified by the target exactly as when that arm runs alone. Which
arm runs depends only on the counts of committed tokens and on measured times, never on the target's
output for tokens not yet verified, so greedy output is the target's whatever is chosen and sampled
output keeps the target's distribution. A seeded request under the default seeded rule (Gumbel-max
noise keyed by seed and token index, `specrt.runtime.seeded`) drafts greedily and its text does not
depend on the drafts, so the clock chooses for it too (`begin_request` hands over the rule). A seeded
request whose seed drives rejection sampling's coins (`seeded_sampling="stream"`, and any seeded
request whose rule was not handed over) runs one arm for the whole request (the drafter where there
is one, else the copies; a named arm without probes): choices that follow the clock would consume
its random stream differently from one run to the next.

Drafter state. The drafter's cache mirrors the target's, so it must see every committed token. While
other arms run (or the drafter arm verifies the copies alone), committed tokens and their taps wait in
the drafter's backlog (`backlog.py`) and are ingested in one call when the drafter next drafts.
That catch-up is charged to the drafting round only as one round's share. The prompt waits there
too, from prefill to the drafter's first drafting round, and its ingest is charged to no round: a
request the drafter never drafts in (sampled text where plain rounds lead) never pays for it (EAGLE-3
on an 87-token prompt: ~20 ms of a ~2.5 s request), and no request's first token waits for it. The
copies' index is fed every round (a few dict writes per token). The target returns the drafter's
taps every round, whichever arm runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from specrt.export.draft_options import DEFAULT_ALONE_ABOVE
from specrt.runtime.proposers.backlog import DrafterBacklog
from specrt.runtime.proposers.base import Proposal, coupled
from specrt.runtime.proposers.lookup import copy_proposal
from specrt.runtime.sampling import SamplingParams

PLAIN, COPIES, DRAFTER = "plain", "copies", "drafter"
_EMPTY = Proposal.chain(torch.empty(0, dtype=torch.long))  # a plain step: the anchor alone
MIN_PLAIN_RUN = 2  # a plain run shorter than this goes round by round (`plain_run`)
NOTE_MARGIN = 1.10  # the named drafter must trail the best other arm by more than this to earn a note


@dataclass
class ArmRate:
    """Decayed sums of one arm's yield and cost, and this request's plain sums (for the note)."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: float = 0.0  # decayed like tokens and seconds: tokens / rounds is the arm's recent yield
    count: int = 0
    last: int = -1  # round index it last ran
    request_tokens: int = 0
    request_seconds: float = 0.0
    request_rounds: int = 0

    def add(self, tokens: int, seconds: float, decay: float, rounds: int = 1) -> None:
        """One sample: a round, or a plain run of `rounds` rounds measured as one."""
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.rounds = self.rounds * decay + rounds
        self.count += 1
        self.request_tokens += tokens
        self.request_seconds += seconds
        self.request_rounds += rounds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds > 0 else 0.0

    @property
    def request_rate(self) -> float:
        return self.request_tokens / self.request_seconds if self.request_seconds > 0 else 0.0


class AutoProposer:
    """Runs plain, copies and drafter rounds by measured tokens/s (module docstring)."""

    free_drafts = False

    def __init__(self, copies, drafter=None, pinned: str | None = None, *, warmup: int = 2, decay: float = 0.8,
                 first_probe: int = 8, max_probe: int = 64, pinned_first_probe: int = 4, pinned_max_probe: int = 32,
                 carry: float = 0.25, fixed_when_seeded: bool = True, alone_above: float = DEFAULT_ALONE_ABOVE,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.copies = copies
        self.alone_above = float(alone_above)  # a copy this likely right is verified in a plain round too
        self.drafter = drafter
        # the drafter alone, and what it has not ingested: WithLookup's own backlog (it catches up only
        # when its round drafts), or one here for a drafter without copies (--lookup 0)
        self.inner = getattr(drafter, "inner", drafter) if drafter is not None else None
        self.backlog = getattr(drafter, "backlog", None)
        if drafter is not None and self.backlog is None:
            self.backlog = DrafterBacklog(drafter)
        if drafter is not None and hasattr(drafter, "observe_copies"):
            # one copy index for both arms, fed once per round (same settings: one DraftOptions)
            drafter.lookup = copies.lookup
        if drafter is not None and hasattr(copies, "step_cost") and "step_cost" in vars(drafter):
            # one step cost line for both arms: every round's verify time, whoever drafted it
            drafter.step_cost = copies.step_cost
        self.arms = (COPIES, DRAFTER, PLAIN) if drafter is not None else (COPIES, PLAIN)
        # `_best` compares in this order: max keeps the first of equal estimates, so ties go to plain
        self.plain_first = (PLAIN,) + tuple(a for a in self.arms if a != PLAIN)
        if pinned is not None and pinned not in self.arms:
            raise ValueError(f"pinned arm {pinned!r} is not one of {self.arms}")
        self.pinned = pinned
        self.labels = {PLAIN: "plain", COPIES: copies.name, DRAFTER: drafter.name if drafter is not None else ""}
        self.name = "auto" if pinned is None else self.labels[pinned]
        self.tap_layers = tuple(drafter.tap_layers) if drafter is not None else ()
        self.max_drafts = max(copies.max_drafts, drafter.max_drafts if drafter is not None else 0)
        self.warmup, self.decay, self.carry = int(warmup), float(decay), float(carry)
        self.first_probe, self.max_probe = (int(pinned_first_probe), int(pinned_max_probe)) if pinned else (
            int(first_probe), int(max_probe))
        self.fixed_when_seeded = bool(fixed_when_seeded)
        self.clock = clock
        self.rates = {arm: ArmRate() for arm in self.arms}
        self.leader: str | None = None
        self.seeded_sampling = "stream"
        self._new_request(0)

    # ---------------------------------------------------------------- the Proposer interface
    def reset(self, batch_size: int, capacity: int) -> None:
        self.seeded_sampling = "stream"  # until `begin_request` says otherwise: no clock for a seed
        self.copies.reset(batch_size, capacity)
        if self.drafter is not None:  # WithLookup's reset: its drafter, sizing and idle rule too
            self.drafter.reset(batch_size, capacity)
            self.backlog.drop()
        self._new_request(batch_size)

    def begin_request(self, sampling: SamplingParams, seeded_sampling: str = "noise") -> None:
        """The request's sampling settings (the arms' idle rules carry what requests sampled alike
        learned) and what its seed drives (`specrt.runtime.generate`): "noise" lets the clock choose."""
        self.seeded_sampling = seeded_sampling
        for arm in (self.copies, self.drafter):
            begin = getattr(arm, "begin_request", None)
            if begin is not None:
                begin(sampling, seeded_sampling)

    def _new_request(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.open: str | None = None  # the arm of the round in flight
        self.open_rounds = 1  # rounds it holds: more for a plain run (`plain_run`)
        self.started = 0.0
        self.credit = 0.0  # seconds of the round not charged to its arm (drafter catch-up)
        self.round_tokens = 0
        self.round = 0
        self.since_probe = 0
        self.probe_every = self.first_probe
        for r in self.rates.values():  # what earlier requests measured, at a lower weight
            r.tokens, r.seconds, r.rounds = r.tokens * self.carry, r.seconds * self.carry, r.rounds * self.carry
            r.request_tokens, r.request_seconds, r.request_rounds, r.last = 0, 0.0, 0, -1

    @property
    def lengths(self) -> list[int]:
        return self.copies.lengths

    def context_length(self, row: int) -> int:
        return self.copies.context_length(row)

    def observe(self, rows: Sequence[int], tokens: Sequence[Sequence[int]], taps: Sequence[torch.Tensor],
                next_tokens: Sequence[int]) -> None:
        if self.open is not None:
            self.round_tokens += sum(len(t) for t in tokens)
            idle = getattr(self.drafter, "idle", None)
            if idle is not None and self.batch_size == 1 and list(rows) == [0]:
                # the drafter arm's idle rule (`verify_length.IdleRounds`) scores its own rounds only;
                # the shared lookup is fed below, through the copies arm
                idle.observe_accepted(len(tokens[0]) - 1)
        self.copies.observe(rows, tokens, taps, next_tokens)
        if self.inner is None:
            return
        # the prompt (at prefill, no round open) waits with the rest: ingested when the drafter first drafts
        self.backlog.hold(rows, tokens, taps, next_tokens, prompt=self.open is None)

    def observe_step_time(self, batch: int, positions: int, seconds: float) -> None:
        timer = getattr(self.copies, "observe_step_time", None)
        if timer is not None:  # the copies size themselves by the step cost (step_cost.py), a stall clipped
            seconds = timer(batch, positions, seconds)
        idle = getattr(self.drafter, "idle", None)
        if idle is not None and batch == 1:  # the drafter arm's idle rule weighs its rounds' verify cost
            idle.observe_verify(seconds)

    def propose(self, rows: Sequence[int], anchors: Sequence[int], sampling: SamplingParams,
                generator: torch.Generator | None, noise=None) -> list[Proposal]:
        # noise: seeded rows' couplings, for a drafter that `couples_noise` (read through __getattr__)
        now = self.clock()
        if self.open is not None:
            self._close(now)
        arm = self._choose(sampling)
        paying = self._paying_copies(rows, sampling) if arm == PLAIN else None
        if paying is not None and self.pinned != PLAIN:
            arm = COPIES  # a round without the drafter verifies the copies that pay: a copies round
        self.open, self.started, self.credit, self.open_rounds = arm, now, 0.0, 1
        self.rates[arm].last = self.round
        self.round += 1
        if arm == PLAIN:
            return [_EMPTY] * len(rows)
        if arm == COPIES:
            return paying if paying is not None else self.copies.propose(rows, anchors, sampling, generator)
        self.backlog.clear_last()
        if self.backlog.drafter is self.drafter:  # WithLookup catches up itself, only if it drafts
            self.backlog.catch_up()
        proposals = self.drafter.propose(rows, anchors, sampling, generator, **coupled(noise))
        # a drafter running every round ingests one round's tokens per round: charge that share only
        # (and none of a held prompt's ingest: prefill work, not this round's)
        seconds, rounds = self.backlog.last
        self.credit = seconds * (1.0 - 1.0 / max(rounds, 1)) + self.backlog.prompt_seconds
        return proposals

    def _paying_copies(self, rows: Sequence[int], sampling: SamplingParams) -> list[Proposal] | None:
        """The copies of a round chosen to run plain, where they pay by their own rule, else None.

        The copies are looked up in plain rounds anyway (a few dict reads per row): scored once the
        target answers, the copy record keeps learning. Where the lookup's own rule keeps a copy (at
        batch 1 with greedy drafts and a measured step cost: the copy the cost cut keeps, usually
        none away from repeated text; else a confident copy, first copy at least `alone_above`
        likely), the round runs the copies instead: they cost no forward, and verified they pay.
        Measured on the int4 DSpark folder, 8 HumanEval prompts: auto 1.30x plain decoding against
        1.24x with plain rounds that verify nothing (repeated text no longer waits for a probe of
        the copies arm)."""
        lookup = getattr(self.copies, "lookup", None)
        if lookup is None:
            return None
        step_cost = getattr(self.copies, "step_cost", None)
        if step_cost is not None and sampling.greedy and self.batch_size == 1 and list(rows) == [0]:
            cost = step_cost.line(1)
            if cost is not None:
                copy = lookup.chain(0, cost)
                return [copy_proposal(copy)] if copy.tokens else None
        chains = [lookup.chain(b) for b in rows]
        confident = [bool(c.survival) and c.survival[0] >= self.alone_above for c in chains]
        if not any(confident):
            return None
        return [copy_proposal(c) if sure else _EMPTY for c, sure in zip(chains, confident)]

    def plain_run(self, sampling: SamplingParams) -> int:
        """How many coming rounds of the lone row run plain in one go, with no `propose` or per-round
        `observe` until they are done (`DecodeStep`, plain runs): 0 means round by round.

        A run is the rounds `_choose` would give plain anyway: plain leads (or a named drafter sits
        out, `dormant`) and the next probe is that many rounds away. Measured as one sample of that
        many rounds, it moves the schedule on as that many `_choose` calls would. Sampled requests
        only: a greedy plain round looks up the copies that pay (`_paying_copies`), which is most of
        what copies bring, while at temperature > 0 a copy is rarely that sure (text sampled at
        temperature 1 takes a copy ~1 time in 7) and the lookup's ~0.1 ms a round is a cost of its
        own. Lossless: the run's length depends on counts and measured times only."""
        if sampling.greedy or self.batch_size != 1 or self._one_arm(sampling):
            return 0
        now = self.clock()
        if self.open is not None:
            self._close(now)
        rounds = self.probe_every - 1 - self.since_probe
        if (self._warming_up() is not None or self.leader != PLAIN or self._lead() != PLAIN
                or rounds < MIN_PLAIN_RUN):
            return 0
        self.open, self.started, self.credit, self.open_rounds = PLAIN, now, 0.0, rounds
        self.round += rounds
        self.since_probe += rounds
        self.rates[PLAIN].last = self.round - 1
        return rounds

    # ---------------------------------------------------------------- measuring and choosing
    def _close(self, now: float) -> None:
        arm = self.open
        self.rates[arm].add(self.round_tokens, max(now - self.started - self.credit, 1e-9), self.decay,
                            self.open_rounds)
        self.round_tokens = 0
        self.open = None

    @property
    def dormant(self) -> bool:
        """A named drafter measured slower than plain rounds: rounds run plain (module docstring)."""
        if self.pinned != DRAFTER:
            return False
        mine, plain = self.rates[DRAFTER], self.rates[PLAIN]
        return mine.count > 0 and plain.count > 0 and plain.rate >= self.estimate(DRAFTER)

    def estimate(self, arm: str) -> float:
        """The arm's tokens per second, bounded by its yield: a round with drafts runs the forward of
        a plain round and more (drafting, verify rows), so an arm whose rounds commit t tokens for
        plain's p runs at most t / p times plain's rate. Where drafts are rarely accepted (sampled
        text) its rounds commit what plain rounds do, and a timing that puts it ahead of plain is
        noise: the bound makes it a tie, which plain wins (`_best`, `dormant`). Unbounded, at
        temperature 1 (int4, 8 MT-bench prompts), arms that landed no draft ran 42-53% of the rounds
        on such timings, at 0.92-0.98x of plain decoding's speed."""
        rate, plain = self.rates[arm], self.rates[PLAIN]
        if arm == PLAIN or plain.count == 0 or plain.tokens_per_round <= 0:
            return rate.rate
        return min(rate.rate, plain.rate * rate.tokens_per_round / plain.tokens_per_round)

    def _best(self) -> str:
        return max(self.plain_first, key=self.estimate)

    def _one_arm(self, sampling: SamplingParams) -> bool:
        """A request whose seed drives rejection sampling's coins: one arm throughout (module docstring)."""
        return (self.fixed_when_seeded and not sampling.greedy and sampling.seed is not None
                and self.seeded_sampling != "noise")

    def _warming_up(self) -> str | None:
        """`--drafter auto`'s arm still in its warm-up rounds, if any."""
        if self.pinned is None:
            for arm in self.arms:
                if self.rates[arm].count < self.warmup:
                    return arm
        return None

    def _lead(self) -> str:
        """The arm the measurements put first now: the best estimate, or the named arm unless it sits out."""
        if self.pinned is None:
            return self._best()
        return PLAIN if self.dormant else self.pinned

    def _choose(self, sampling: SamplingParams) -> str:
        if self._one_arm(sampling):
            if self.pinned is not None:
                return self.pinned
            return DRAFTER if self.drafter is not None else COPIES
        warming = self._warming_up()
        if warming is not None:
            return warming
        best = self._lead()
        if best != self.leader:  # a new leader (a probe overtook it): look at the others again soon
            self.leader, self.probe_every, self.since_probe = best, self.first_probe, 0
        self.since_probe += 1
        if self.since_probe < self.probe_every:
            return best
        self.since_probe = 0
        self.probe_every = min(2 * self.probe_every, self.max_probe)
        return min((a for a in self.arms if a != best), key=lambda a: self.rates[a].last)

    # ---------------------------------------------------------------- reporting
    def summary(self) -> dict[str, dict[str, float]]:
        """This request's rounds and tokens/s per arm (decode rounds only, prefill excluded)."""
        return {self.labels[a]: {"rounds": r.request_rounds, "tok_s": r.request_rate}
                for a, r in self.rates.items() if r.request_rounds}

    def slower_note(self) -> str | None:
        """One line when a named drafter ran slower on this request than the automatic choice's best
        arm measured in its probes (None otherwise, and always for `auto`)."""
        if self.pinned is None:
            return None
        mine = self.rates[self.pinned]
        if not mine.request_rounds:
            return None
        # this request's probes only, and at least two of an arm: one round of copies is too noisy a witness
        probed = [a for a in self.arms if a != self.pinned and self.rates[a].request_rounds >= 2]
        if not probed:
            return None
        best = max(probed, key=lambda a: self.rates[a].request_rate)
        if self.rates[best].request_rate <= mine.request_rate * NOTE_MARGIN:
            return None
        what = "plain decoding" if best == PLAIN else self.labels[best]
        return (f"note: {self.name} ran at {mine.request_rate:.1f} tok/s on this request, {what} measured "
                f"{self.rates[best].request_rate:.1f} tok/s in probe rounds (--drafter auto picks the fastest)")

    # hooks the serving batcher and the decode step probe with hasattr: never the arms'
    _OWN = frozenset({"begin_request", "observe_copies", "observe_drafter", "propose_copies", "prefix_view", "reset_row",
                      "last_chains", "lookup", "copies", "drafter", "inner", "pinned", "rates"})

    def __getattr__(self, name: str):
        # what callers read off the proposer they asked for (k_cache, top_k, threshold, block_size):
        # the drafter's, else the copies'
        if name.startswith("__") or name in AutoProposer._OWN:
            raise AttributeError(name)
        arm = self.__dict__.get("drafter") or self.__dict__.get("copies")
        if arm is None:
            raise AttributeError(name)
        return getattr(arm, name)

    @property
    def serving_proposer(self):
        """What the serving batcher drives: the drafter with copies (its draft gate and measured gate
        make the same choice per step from their own measurements), else the copies alone."""
        if self.pinned == PLAIN:
            return None
        if self.pinned == COPIES or self.drafter is None:
            return self.copies
        return self.drafter
