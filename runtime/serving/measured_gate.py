"""Speculate only while measured speculative steps outrun measured plain steps.

Algorithm 1 (`policy.schedule_padded`) and the draft gate (`policy.DraftGate`) decide from
predictions: the calibrated SPS table and the calibrated survival / hit rates. Both can be wrong in
ways they cannot see: a table profiled at another context length or load, host time per row that no
target-step profile contains, int4 kernels whose cost per verified row changes with the batch. Once
that made scheduled copies on the int4 engines 0.77x of plain decoding at 4 requests.

This gate looks at what steps actually delivered instead: tokens emitted per second of decode-step
wall time (drafting, verification, host work), kept separately for speculative and plain steps and
for each number of running requests R (the cost of a step depends on R far more than on anything
else here). Each is a ratio of decayed sums (tokens / seconds, decay `decay` a step), so a run of
cheap one-token steps cannot outvote fewer long accepted chains. Per R:

  - warm-up: `warmup` speculative steps, then `warmup` plain ones;
  - then the faster kind runs, and every `probe_every` steps the slower kind runs once, so its
    estimate follows the text (copies pay where the text repeats itself) and the load; while probes
    confirm the order, `probe_every` doubles up to `max_probe`; when the order flips it resets.

What it costs: when speculation wins, one plain step in `probe_every` (from 8 to 64); when it loses,
one speculative step in as many. Plain steps are exact, so the choice never changes an output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0
    count: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.count += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Arm:
    spec: _Rate = field(default_factory=_Rate)
    plain: _Rate = field(default_factory=_Rate)
    since_probe: int = 0
    probe_every: int = 0
    spec_leads: bool | None = None


class MeasuredGate:
    """Per running-request count, run whichever of speculative and plain steps measured faster."""

    def __init__(self, warmup: int = 3, decay: float = 0.9, first_probe: int = 8, max_probe: int = 64) -> None:
        if warmup < 1 or not 0.0 < decay < 1.0 or first_probe < 2 or max_probe < first_probe:
            raise ValueError("MeasuredGate: warmup >= 1, 0 < decay < 1, 2 <= first_probe <= max_probe")
        self.warmup, self.decay = int(warmup), float(decay)
        self.first_probe, self.max_probe = int(first_probe), int(max_probe)
        self.arms: dict[int, _Arm] = {}

    def _arm(self, rows: int) -> _Arm:
        arm = self.arms.get(rows)
        if arm is None:
            arm = self.arms[rows] = _Arm(probe_every=self.first_probe)
        return arm

    def speculate(self, rows: int) -> bool:
        """Should a step over `rows` running requests speculate?"""
        arm = self._arm(rows)
        if arm.spec.count < self.warmup:
            return True
        if arm.plain.count < self.warmup:
            return False
        leads = arm.spec.rate >= arm.plain.rate
        arm.since_probe += 1
        if arm.since_probe >= arm.probe_every:  # probe the slower kind
            arm.since_probe = 0
            choice = not leads
        else:
            choice = leads
        return choice

    def record(self, rows: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A decode step over `rows` requests emitted `tokens` in `seconds`; `speculative`: it verified drafts."""
        arm = self._arm(rows)
        (arm.spec if speculative else arm.plain).add(tokens, seconds, self.decay)
        if arm.spec.count < self.warmup or arm.plain.count < self.warmup:
            return
        leads = arm.spec.rate >= arm.plain.rate
        if arm.spec_leads is not None and leads != arm.spec_leads:
            arm.probe_every = self.first_probe  # the order flipped: look more often again
        elif arm.since_probe == 0 and arm.spec_leads is not None:
            arm.probe_every = min(arm.probe_every * 2, self.max_probe)  # a probe confirmed the order
        arm.spec_leads = leads

    def summary(self) -> dict[int, dict[str, float]]:
        """Measured tokens/s per running-request count (the server's /metrics shows it)."""
        return {rows: {"speculative_tok_s": arm.spec.rate, "plain_tok_s": arm.plain.rate}
                for rows, arm in sorted(self.arms.items())}
