"""Verify-length policies: Algorithm 1 under the padded step cost, tree selection, survivals the
proposers report, and the draft gate."""

from __future__ import annotations

import time

import pytest
import torch
from specrt.runtime.backends.torch_backend import TorchTargetEngine
from specrt.runtime.generate import generate_autoregressive
from specrt.runtime.proposers.base import Proposal
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import SpsTable, schedule
from specrt.runtime.serving.batcher import Batcher, Request
from specrt.runtime.serving.policy import (
    DraftGate,
    apply_schedule,
    node_order,
    ordered_survival,
    plan_lengths,
    schedule_padded,
    select_nodes,
)
from test_speculative import block, eagle3, tiny_target

pytestmark = pytest.mark.timeout(60)


def affine(per_token: float):
    return lambda b: 1.0 / (1.0 + per_token * b)


def test_padded_schedule_charges_the_longest_row():
    # two requests in a 2-row step. Admitting (0, 1) costs 2 positions (both rows grow to 2 tokens),
    # after which (1, 1) is free; (0, 2) costs 2 more.
    surv = [[0.9, 0.8, 0.1], [0.5]]
    plan = schedule_padded(surv, affine(0.1), step_rows=2)
    # theta: start 2/(1.2)=1.667; +0.9 @B=4: 2.9/1.4=2.071; +0.8 (depth 2) @B=6: 3.7/1.6=2.3125;
    # +0.5 (free) @B=6: 4.2/1.6=2.625; +0.1 (depth 3) @B=8: 4.3/1.8=2.389 -> stop
    assert plan.lengths == [2, 1] and plan.tokens == 6
    assert plan.tau == pytest.approx(4.2) and plan.throughput == pytest.approx(4.2 / 1.6)
    assert plan.baseline == pytest.approx(2 / 1.2)
    # a costlier device stops at the first depth: 2.9/(1+4c) <= 2/(1+2c) for c >= 0.9/2.2
    assert schedule_padded(surv, affine(0.5), step_rows=2).lengths == [0, 0]
    # idle rows inside the step are padded too: a 6-row step pays 6 positions per depth
    # (c = 0.3: 2 rows: 2/1.6 -> 2.9/2.2 admits; 6 rows: 2/2.8 -> 2.9/4.6 stops)
    assert schedule_padded(surv, affine(0.3), step_rows=2).lengths == [2, 1]
    assert schedule_padded(surv, affine(0.3), step_rows=6).lengths == [0, 0]


def test_packed_cost_is_the_paper_scheduler():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        surv = [torch.rand(int(torch.randint(0, 6, (1,), generator=g)), generator=g).sort(descending=True)
                .values.cumprod(0).tolist() for _ in range(4)]
        sps = affine(float(torch.rand(1, generator=g)) * 0.2)
        assert plan_lengths(surv, sps, 4, "packed") == schedule(surv, sps)


def test_padded_schedule_respects_the_table_range():
    table = SpsTable([1, 2, 4], [10.0, 9.0, 8.0])
    plan = schedule_padded([[0.99, 0.99, 0.99], [0.99]], table, step_rows=2)
    assert plan.tokens <= 4 and plan.lengths == [1, 1]


def random_tree(g: torch.Generator, n: int) -> Proposal:
    parents, logp = [], []
    for i in range(n):
        par = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
        parents.append(par)
        local = float(torch.log(torch.rand(1, generator=g)))
        logp.append(local + (logp[par] if par >= 0 else 0.0))
    return Proposal(torch.arange(100, 100 + n), torch.tensor(parents), None, False, 0,
                    torch.tensor(logp).exp())


def test_every_prefix_of_the_survival_order_is_a_subtree():
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        p = random_tree(g, 9)
        order = node_order(p)
        values = ordered_survival(p, order)
        assert values == sorted(values, reverse=True)
        for k in range(len(p) + 1):
            sub = select_nodes(p, order[:k])  # raises when a parent is missing
            assert len(sub) == k
            kept = sorted(order[:k])
            for new, old in enumerate(kept):  # the renumbered parent is the same node
                old_parent = int(p.parents[old])
                new_parent = int(sub.parents[new])
                assert (old_parent < 0 and new_parent < 0) or kept[new_parent] == old_parent
                assert int(sub.tokens[new]) == int(p.tokens[old])


def test_select_nodes_refuses_an_orphan():
    p = Proposal(torch.tensor([1, 2]), torch.tensor([-1, 0]), None, False, 2, torch.tensor([0.5, 0.4]))
    with pytest.raises(ValueError, match="without its parent"):
        select_nodes(p, [1])


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("kind", ["dflash", "dspark", "eagle3"])
def test_proposers_report_survivals(target, kind):
    proposer = eagle3(target) if kind == "eagle3" else block(target, kind)
    engine = TorchTargetEngine(target, 64, 2)
    batcher = Batcher(engine, proposer)
    batcher.add(Request([5, 9, 13], 4))
    batcher.add(Request([11, 3, 8, 1], 4))
    batcher.step()  # prefill + one decode step: the proposer has context now
    props = proposer.propose([0, 1], [r.anchor for r in batcher.running.values()], SamplingParams(), None)
    for p in props:
        assert p.survival is not None and p.survival.shape == (len(p),)
        s = p.survival.tolist()
        assert all(0.0 <= a <= 1.0 for a in s)
        parents = p.parents.tolist()
        assert all(s[i] <= s[par] + 1e-6 for i, par in enumerate(parents) if par >= 0)
    if kind == "dspark":
        assert torch.allclose(props[0].survival, proposer.last_survival[0, : len(props[0])].float())


def test_draft_gate_backs_off_and_recovers():
    gate = DraftGate(first_backoff=2, max_backoff=8)
    assert gate.should_draft()
    gate.record(1.0, 2.0)  # a loss: closed for 2 steps
    assert [gate.should_draft() for _ in range(3)] == [False, False, True]
    gate.record(1.0, 2.0)  # another: 4 steps
    assert [gate.should_draft() for _ in range(5)] == [False] * 4 + [True]
    gate.record(3.0, 2.0)  # a win resets the back-off
    assert gate.backoff == 2 and gate.should_draft()
    gate.record(1.0, 2.0, probe_cost=3.0)  # a probe worth 3 plain steps: closed 3 / 5% = 60 steps
    assert gate.closed_for == 60
    gate.record(1.0, 2.0, probe_cost=1e6)
    assert gate.closed_for == gate.longest


class SlowProposer:
    """A real proposer that also burns time, so drafting cannot pay on a fast step table."""

    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def __getattr__(self, name):
        if name == "inner":  # copy.copy probes attributes before __init__ state exists
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.inner.propose(*args, **kwargs)


def test_the_gate_stops_drafting_that_does_not_pay_and_stays_lossless(target):
    prompts = [[5, 9, 13, 2], [11, 3], [7, 7, 7]]
    alone = [generate_autoregressive(TorchTargetEngine(target, 128), [p], 30, SamplingParams()).tokens[0]
             for p in prompts]
    fast = SpsTable([1, 1024], [1000.0, 999.0])  # a 1 ms step whatever its size: drafting time dominates
    proposer = SlowProposer(block(target, "dspark"), 0.01)
    batcher = Batcher(TorchTargetEngine(target, 128, 3), proposer, "confidence", fast, measured_gate=False)
    requests = [batcher.add(Request(p, 30)) for p in prompts]
    batcher.run_until_done()
    assert [r.tokens for r in requests] == alone
    # one probe cost ~10 plain steps (10 ms vs a 1 ms step): closed for >= 10 / 5% = 200 steps
    assert batcher.counters.draft_steps == batcher.gate.probes == 1
    assert batcher.gate.skipped == batcher.counters.steps - 1 and batcher.gate.closed_for > 150
    ungated = Batcher(TorchTargetEngine(target, 128, 3), proposer, "confidence", fast, draft_gate=False,
                      measured_gate=False)
    requests = [ungated.add(Request(p, 30)) for p in prompts]
    ungated.run_until_done()
    assert [r.tokens for r in requests] == alone and ungated.counters.draft_steps == ungated.counters.steps


def test_apply_schedule_cuts_chains_and_trees(target):
    chain = Proposal.chain(torch.tensor([1, 2, 3, 4]), None, torch.tensor([0.9, 0.6, 0.3, 0.1]))
    tree = Proposal(torch.tensor([7, 8, 9]), torch.tensor([-1, -1, 0]), None, False, 2, torch.tensor([0.7, 0.2, 0.6]))
    cut, plan = apply_schedule([chain, tree], affine(0.02), step_rows=2, cost="packed")
    assert plan.lengths == [len(cut[0]), len(cut[1])]
    assert cut[0].tokens.tolist() == [1, 2, 3, 4][: plan.lengths[0]]
    if plan.lengths[1] == 2:
        assert cut[1].tokens.tolist() == [7, 9] and cut[1].parents.tolist() == [-1, 0] and cut[1].depth == 2


def test_the_gate_stays_open_when_drafts_pay(target):
    """A perfect drafter on a device where a step costs the same at any size: every step drafts."""
    from test_speculative import OracleProposer

    prompts = [[5, 9, 13, 2], [11, 3]]
    expected = [generate_autoregressive(TorchTargetEngine(target, 128), [p], 40, SamplingParams()).tokens[0]
                for p in prompts]
    oracle = OracleProposer(expected, [len(p) for p in prompts], k=4, tree=False)  # no survivals: taken as 1
    flat = SpsTable([1, 1024], [1000.0, 999.0])
    batcher = Batcher(TorchTargetEngine(target, 128, 2), oracle, "confidence", flat, measured_gate=False)
    requests = [batcher.add(Request(p, 30)) for p in prompts]
    batcher.run_until_done()
    assert [r.tokens for r in requests] == [e[:30] for e in expected]
    c = batcher.counters
    assert batcher.gate.skipped == 0 and c.draft_steps == c.steps and c.emitted / c.row_steps > 4
