"""How many drafts each request verifies in a step: fixed, or DSpark's Algorithm 1 over survivals.

`fixed`: every proposal is verified as the proposer made it (DFlash: the whole block; DSpark: cut
by its confidence threshold, as in `specrt generate`; EAGLE-3: the whole tree).

`confidence`: the scheduler of DSpark's Algorithm 1 (`specrt.runtime.scheduler`, DESIGN.md
section 3) picks each request's verify length from the proposals' survival estimates
(`Proposal.survival`) and the device's SPS table:
  - DSpark: the calibrated survival prod sigmoid(z_i / T_i) of its confidence head;
  - DFlash: the running product of each position's top draft probability (q_k's mode: it never
    looks at the drawn token, so the verify length stays a stopping time and sampling stays lossless);
  - EAGLE-3: exp(cumulative draft log-prob) of each tree node. A tree's nodes are ordered by survival
    (ties: node index); a parent never scores below its child and comes first, so every prefix of
    that order is a subtree (`select_nodes`). The tree is a deterministic function of the context,
    so any selection is lossless.

Step cost. The paper's B is the number of verify tokens of a step on an engine that packs them.
Our engines pad every row of a step to the longest one, so a step with R rows and at most l drafts
per row computes R * (1 + l) token positions. `cost="padded"` (the default) charges exactly that:
candidates are still admitted in Algorithm 1's order with its early stop (so the losslessness
argument of `specrt.runtime.scheduler` holds unchanged: a decision depends only on candidates sorted
before it), but B is R_step * (1 + longest admitted). `cost="packed"` is the paper's B = R + sum l
and delegates to `specrt.runtime.scheduler.schedule`; the batcher takes it for engines that run each
row of a batch as its own call on its real tokens (int8-activation ORT engines: no padding to pay).

Draft gate. Algorithm 1 decides after the drafts exist; their cost is sunk. When the drafter keeps
losing (its predicted tokens per second, drafting time included, below plain decoding's), `DraftGate`
skips drafting and probes again after a back-off. Decisions use past steps only, so they cannot bias
the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from specrt.runtime.proposers.base import Proposal
from specrt.runtime.scheduler import Schedule, SpsTable, schedule

SCHEDULES = ("fixed", "confidence")


def node_order(p: Proposal) -> list[int]:
    """Nodes by survival, highest first (ties: lower index). Without survivals: index order."""
    n = len(p)
    if p.survival is None:
        return list(range(n))
    values = p.survival.tolist()
    return sorted(range(n), key=lambda i: (-values[i], i))


def ordered_survival(p: Proposal, order: list[int]) -> list[float]:
    """Survivals along `order`, clamped to [0, 1] and made non-increasing (float rounding guard)."""
    if p.survival is None:
        return [1.0] * len(order)
    values = p.survival.tolist()
    out: list[float] = []
    for i in order:
        a = min(max(float(values[i]), 0.0), 1.0)
        out.append(min(a, out[-1]) if out else a)
    return out


def select_nodes(p: Proposal, nodes: Sequence[int]) -> Proposal:
    """The sub-proposal of an ancestor-closed node set, renumbered in topological (index) order."""
    keep = sorted(int(i) for i in nodes)
    if keep == list(range(len(p))):
        return p
    if p.is_chain:
        return p.truncated(len(keep))
    index = {old: new for new, old in enumerate(keep)}
    parents = p.parents.tolist()
    new_parents = []
    for old in keep:
        par = parents[old]
        if par >= 0 and par not in index:
            raise ValueError(f"node {old} kept without its parent {par}")
        new_parents.append(-1 if par < 0 else index[par])
    sel = torch.tensor(keep, dtype=torch.long)
    probs = None if p.draft_probs is None else p.draft_probs[sel]
    survival = None if p.survival is None else p.survival[sel]
    depths: list[int] = []
    for par in new_parents:
        depths.append(1 if par < 0 else depths[par] + 1)
    return Proposal(p.tokens[sel], torch.tensor(new_parents, dtype=torch.long), probs, False,
                    max(depths, default=0), survival)


def schedule_padded(survivals: Sequence[Sequence[float]], sps: SpsTable | Callable[[int], float],
                    step_rows: int, max_tokens: int | None = None) -> Schedule:
    """Algorithm 1 (sorted candidates, early stop) with B = step_rows * (1 + longest admitted length).

    survivals[r]: non-increasing values in [0, 1]; step_rows >= len(survivals) is the number of
    rows the step computes (idle rows inside the step's row range count: they are padded too).
    """
    n_req = len(survivals)
    lengths = [0] * n_req
    if n_req == 0:
        return Schedule([], 0.0, 0, 0.0, 0.0)
    if max_tokens is None and isinstance(sps, SpsTable):
        max_tokens = sps.max_tokens
    step_rows = max(int(step_rows), n_req)
    longest = 0
    tau = float(n_req)
    b = step_rows
    best = tau * float(sps(b))
    baseline = best
    candidates = [(float(a), j, r) for r, row in enumerate(survivals) for j, a in enumerate(row, start=1) if a > 0.0]
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    for a, j, r in candidates:
        new_b = step_rows * (1 + max(longest, j))
        if max_tokens is not None and new_b > max_tokens:
            break
        theta = (tau + a) * float(sps(new_b))
        if not theta > best:
            break  # the early stop of Algorithm 1
        assert j == lengths[r] + 1, "survivals must be non-increasing"
        lengths[r] = j
        longest = max(longest, j)
        tau += a
        b = new_b
        best = theta
    return Schedule(lengths, tau, b, best, baseline)


def plan_lengths(survivals: Sequence[Sequence[float]], sps, step_rows: int, cost: str = "padded") -> Schedule:
    if cost == "packed":
        return schedule(survivals, sps)
    if cost != "padded":
        raise ValueError(f"unknown step cost model {cost!r} (padded | packed)")
    return schedule_padded(survivals, sps, step_rows)


def apply_schedule(proposals: list[Proposal], sps, step_rows: int, cost: str = "padded") -> tuple[list[Proposal], Schedule]:
    """Cut each proposal to the nodes Algorithm 1 admits for it."""
    orders = [node_order(p) for p in proposals]
    plan = plan_lengths([ordered_survival(p, o) for p, o in zip(proposals, orders)], sps, step_rows, cost)
    return [select_nodes(p, o[:n]) for p, o, n in zip(proposals, orders, plan.lengths)], plan


class DraftGate:
    """Skip drafting while it does not pay; probe again after a back-off.

    After each drafting step the batcher reports the scheduler's predicted tokens per second with
    the drafting time included (tau / (draft_s + 1/SPS(B))), plain decoding's (R * SPS(R)), and what
    the drafting cost in plain steps (draft_s * SPS(R)). A loss closes the gate for
    max(backoff, probe_cost / max_overhead) steps, so probing a losing drafter costs at most
    `max_overhead` of plain decoding's time; `backoff` doubles (to `max_backoff`) while losses go on,
    and a win resets it.
    """

    def __init__(self, first_backoff: int = 4, max_backoff: int = 64, max_overhead: float = 0.05,
                 longest: int = 1024) -> None:
        self.first_backoff, self.max_backoff = int(first_backoff), int(max_backoff)
        self.max_overhead, self.longest = float(max_overhead), int(longest)
        self.backoff = self.first_backoff
        self.closed_for = 0
        self.skipped = 0
        self.probes = 0

    def should_draft(self) -> bool:
        if self.closed_for > 0:
            self.closed_for -= 1
            self.skipped += 1
            return False
        return True

    def record(self, with_drafts: float, plain: float, probe_cost: float = 0.0) -> None:
        self.probes += 1
        if with_drafts >= plain:
            self.backoff = self.first_backoff
            return
        by_cost = int(probe_cost / self.max_overhead) if self.max_overhead > 0 else 0
        self.closed_for = min(max(self.backoff, by_cost), self.longest)
        self.backoff = min(self.backoff * 2, self.max_backoff)
