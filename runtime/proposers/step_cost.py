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
"""

from __future__ import annotations


class StepCost:
    def __init__(self, decay: float = 0.9, min_samples: int = 3, weight_cap: int = 20) -> None:
        self.decay, self.min_samples, self.weight_cap = float(decay), int(min_samples), int(weight_cap)
        self.mean: dict[tuple[int, int], float] = {}
        self.count: dict[tuple[int, int], int] = {}
        self.lines: dict[int, tuple[float, float] | None] = {}  # per batch size, until the next observe

    def observe(self, batch: int, positions: int, seconds: float) -> None:
        key = (int(batch), int(positions))
        old = self.mean.get(key)
        self.mean[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        self.count[key] = self.count.get(key, 0) + 1
        self.lines.pop(key[0], None)

    def line(self, batch: int = 1) -> tuple[float, float] | None:
        """(c0, c1) with cost(T) ~ c0 + c1 T for this batch size, or None while too little is known."""
        if batch not in self.lines:
            self.lines[batch] = self._fit(batch)
        return self.lines[batch]

    def _fit(self, batch: int) -> tuple[float, float] | None:
        pts = [(t, m, min(self.count[(b, t)], self.weight_cap)) for (b, t), m in self.mean.items()
               if b == batch and self.count[(b, t)] >= self.min_samples]
        if len({t for t, _, _ in pts}) < 2:
            return None
        w = sum(n for _, _, n in pts)
        mt = sum(n * t for t, _, n in pts) / w
        mc = sum(n * m for _, m, n in pts) / w
        var = sum(n * (t - mt) ** 2 for t, _, n in pts)
        c1 = max(sum(n * (t - mt) * (m - mc) for t, m, n in pts) / var, 0.0)
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
