"""What a verify step of T positions costs on this engine, measured as generation runs.

Why. A copied token is worth a verify row when its chance of being accepted beats what the row
costs, and on a CPU that cost moves: at one thread count, machine load and weight format a row costs
8% of a one-token step, at another 25% (int4 here: T=1 7.1 ms, T=16 32.6 ms on one day, 5.8 / 18.1 ms
on another). A fixed survival threshold cannot follow that: with the copy datastore proposing more
low-odds copies, one measurement gave 21% more tokens per step for 18% longer steps. So the lookup
proposer at batch 1 chooses its copy length the way DSpark's Algorithm 1 does for one request: the
length L maximising (1 + sum of the first L survivals) / cost(1 + L), with cost from this model. A
drafter with copies grafted on sizes its whole round the same way, its own drafting time added to
c0 (`verify_length.py`).

What. Per (batch, T) an exponentially decayed mean of measured forward seconds, and a least-squares
line cost(T) = c0 + c1 T over the T's seen (each weighted by its sample count, capped so a flood of
one T does not hide the others). `line()` is None until two distinct T's have `min_samples` each:
until then the caller keeps its threshold. Timing-dependent choices are made only for greedy
requests (their output cannot depend on drafts); a seeded sampled request drafts the same way every
run.

Stalls. A verify step now and then takes far longer than its rows explain (another process took the
cores, the process was paged out). Taken at face value one such sample locks the sizing: a 0.5 s
stall on the longest T seen (17 rows, ~39 ms) left its mean at 69 ms, the line's slope doubled, the
copies were cut to a row or two from then on, so that T was never verified again to correct it
(int4 folder, `--drafter lookup`, HumanEval prompts: tau 2.0 before the stall, 1.0-1.2 on every
request after it). Two rules keep one bad sample local:
- a sample counts at most `clip` x what its T is expected to cost (its mean, or the line's
  prediction while the T has fewer than `min_samples`): a stall moves the mean by at most
  (clip - 1)(1 - decay) of it, while a lasting change (a longer context, a busier machine) still
  comes through within a few samples;
- the line is fitted to the T's measured in the last `stale_after` steps of that batch size (all of
  them while fewer than two distinct T's are that recent): a T that has stopped being verified
  stops steering the choice that keeps it from being verified.
"""

from __future__ import annotations

STALL_CLIP = 2.0  # a timed sample counts at most this many times what it was expected to take (docstring)


def timed_mean(old: float | None, seconds: float, decay: float, clip: float = STALL_CLIP) -> float:
    """A decayed mean of measured seconds in which one stall counts as `clip` x the mean so far, no more
    (module docstring: stalls)."""
    if old is None:
        return seconds
    return decay * old + (1 - decay) * min(seconds, clip * old)


class StepCost:
    def __init__(self, decay: float = 0.9, min_samples: int = 3, weight_cap: int = 20, clip: float = STALL_CLIP,
                 stale_after: int = 512) -> None:
        self.decay, self.min_samples, self.weight_cap = float(decay), int(min_samples), int(weight_cap)
        self.clip, self.stale_after = float(clip), int(stale_after)
        self.mean: dict[tuple[int, int], float] = {}
        self.count: dict[tuple[int, int], int] = {}
        self.last: dict[tuple[int, int], int] = {}  # the batch size's step number that last measured the key
        self.steps: dict[int, int] = {}  # steps measured per batch size
        self.lines: dict[int, tuple[float, float] | None] = {}  # per batch size, until the next observe

    def observe(self, batch: int, positions: int, seconds: float) -> float:
        """Count one step of `positions` rows; returns the seconds counted (a stall clipped)."""
        key = (int(batch), int(positions))
        old = self.mean.get(key)
        if old is not None and self.count[key] >= self.min_samples:
            expected = old
        else:  # a T seen too rarely for its own mean: the line of the others, where there is one
            line = self.line(key[0])
            expected = line[0] + line[1] * key[1] if line is not None else None
        if expected is not None:
            seconds = min(seconds, self.clip * expected)  # a stall counts as a slow step, no more (docstring)
        self.mean[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        self.count[key] = self.count.get(key, 0) + 1
        self.steps[key[0]] = self.steps.get(key[0], 0) + 1
        self.last[key] = self.steps[key[0]]
        self.lines.pop(key[0], None)
        return seconds

    def line(self, batch: int = 1) -> tuple[float, float] | None:
        """(c0, c1) with cost(T) ~ c0 + c1 T for this batch size, or None while too little is known."""
        if batch not in self.lines:
            self.lines[batch] = self._fit(batch)
        return self.lines[batch]

    def _fit(self, batch: int) -> tuple[float, float] | None:
        pts = [(t, m, min(self.count[(b, t)], self.weight_cap), self.last[(b, t)]) for (b, t), m in self.mean.items()
               if b == batch and self.count[(b, t)] >= self.min_samples]
        recent = [p for p in pts if p[3] > self.steps.get(batch, 0) - self.stale_after]
        if len({t for t, *_ in recent}) >= 2:
            pts = recent
        if len({t for t, *_ in pts}) < 2:
            return None
        w = sum(n for _, _, n, _ in pts)
        mt = sum(n * t for t, _, n, _ in pts) / w
        mc = sum(n * m for _, m, n, _ in pts) / w
        var = sum(n * (t - mt) ** 2 for t, _, n, _ in pts)
        c1 = max(sum(n * (t - mt) * (m - mc) for t, m, n, _ in pts) / var, 0.0)
        c0 = mc - c1 * mt
        if c0 <= 0:
            return None
        return c0, c1


def best_length(survival: list[float], cost: tuple[float, float], free_first: bool = False,
                expected: float = 1.0, rows: int = 1) -> tuple[int, float]:
    """Algorithm 1 for one row: (L, tokens per second) for the L maximising
    (expected + sum(survival[:L])) / cost(rows + L). `expected`/`rows`: what the step already holds
    (the anchor alone by default; a first branch when sizing a second); free_first: the engine
    computes a second row anyway, so a one-row step costs what a two-row one does."""
    c0, c1 = cost
    best_l, best_rate = 0, expected / (c0 + c1 * max(rows, 2 if free_first else 1))
    for length, s in enumerate(survival, start=1):
        expected += s
        rate = expected / (c0 + c1 * (rows + length))
        if rate > best_rate:
            best_l, best_rate = length, rate
    return best_l, best_rate
