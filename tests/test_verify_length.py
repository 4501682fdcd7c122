"""Drafter rounds sized by measured costs (`specrt.runtime.proposers.verify_length`): where rows are
expensive the proposals shrink and greedy output stays the target's, where rows are cheap nothing
is cut, sampled requests are never sized by the clock, and a cut tree stays closed under parents."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from specrt.runtime.backends.torch_backend import TorchTargetEngine
from specrt.runtime.proposers.auto import AutoProposer
from specrt.runtime.proposers.base import Proposal
from specrt.runtime.proposers.lookup import LookupProposer, WithLookup
from specrt.runtime.proposers.verify_length import MAX_IDLE, MAX_IDLE_SAMPLED, MIN_SIZED, DraftRecord, IdleRounds, VerifyLength, sized, tree_order
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import generate_speculative
from specrt.runtime.tree import check_parents
from test_lookup import LOOPY
from test_speculative import PROMPTS, block, eagle3, plain, tiny_target

EXPENSIVE = (1.0, 10.0)  # seconds: a verified row costs ten steps (the drafter's few ms are noise beside it)
CHEAP = (1.0, 0.0)  # rows are free: every draft with any chance pays


class FixedCost:
    """A step cost line that does not move (what `StepCost.line` returns once it has measured)."""

    def __init__(self, line: tuple[float, float]) -> None:
        self.fixed = line

    def observe(self, batch: int, positions: int, seconds: float) -> float:
        return seconds  # counted as measured

    def line(self, batch: int = 1) -> tuple[float, float]:
        return self.fixed


@pytest.fixture(scope="module")
def target():
    return tiny_target()


MAKERS = {
    "eagle3-tree": lambda t: WithLookup(eagle3(t), max_tokens=5, threshold=0.0),
    "eagle3-chain": lambda t: WithLookup(eagle3(t, top_k=1), max_tokens=5, threshold=0.0, chain_only=True),
    "dflash-chain": lambda t: WithLookup(block(t, "dflash"), max_tokens=5, threshold=0.0, chain_only=True),
    "dspark-chain": lambda t: WithLookup(block(t, "dspark"), max_tokens=5, threshold=0.0, chain_only=True),
}


N = 24  # tokens per request


@functools.lru_cache(maxsize=None)
def _plain(target, prompt: tuple[int, ...]) -> list[int]:
    return plain(target, [list(prompt)], N)[0]


def plain_text(target, prompt: list[int]) -> list[int]:
    return _plain(target, tuple(prompt))


class NeverIdle(IdleRounds):
    """Every round is sized (the sizing tests look at what sizing does, not at whether it runs)."""

    def idle(self) -> bool:
        self.sized = True
        return False


def run(target, proposer, prompt, cost, sampling=SamplingParams(), n=N, idle=False, seeded_sampling="stream"):
    """Generate with a fixed cost line; returns (tokens, [(inner proposal, returned proposal) per drafter round]).
    idle: keep the proposer's idle rounds (else every round is sized). Every verify step is reported as
    costing what the line says (the tiny model's own seconds are on no line's scale)."""
    proposer.step_cost = FixedCost(cost)
    timer = proposer.observe_step_time
    proposer.observe_step_time = lambda batch, positions, seconds: timer(batch, positions, cost[0] + cost[1] * positions)
    if not idle:
        proposer.idle = NeverIdle()
    rounds: list[list[Proposal]] = []
    inner, outer = proposer.inner.propose, WithLookup.propose

    def inner_propose(*args, **kwargs):
        out = inner(*args, **kwargs)
        rounds.append([out[0]])
        return out

    def outer_propose(self, *args, **kwargs):
        before = len(rounds)
        out = outer(self, *args, **kwargs)
        if len(rounds) > before:
            rounds[-1].append(out[0])
        return out

    proposer.inner.propose = inner_propose
    proposer.propose = outer_propose.__get__(proposer)
    try:
        result = generate_speculative(TorchTargetEngine(target, 256, 1), proposer, [prompt], n, sampling,
                                      seeded_sampling=seeded_sampling)
    finally:
        del proposer.inner.propose, proposer.propose, proposer.observe_step_time
    return result.tokens[0], [tuple(r) for r in rounds if len(r) == 2]


def assert_sizes_every_round_of_a_loop(target, proposer) -> None:
    """Greedy text in a loop, where copies pay: the proposer sizes every round (none idles) and the
    text is plain decoding's."""
    calls = []
    idle = proposer.idle.idle
    proposer.idle.idle = lambda: calls.append(idle()) or calls[-1]
    tokens, _ = run(target, proposer, LOOPY[0], CHEAP, idle=True)
    assert tokens == plain_text(target, LOOPY[0])
    assert calls and not any(calls)


@pytest.mark.parametrize("kind", ["eagle3-tree", "dflash-chain", "dspark-chain"])
def test_expensive_rows_shorten_proposals_and_greedy_output_stays_plain(target, kind):
    proposer = MAKERS[kind](target)
    for prompt in (PROMPTS[0], LOOPY[0]):
        tokens, rounds = run(target, proposer, prompt, EXPENSIVE)
        assert tokens == plain_text(target, prompt)
        for inner, out in rounds:
            check_parents(out.parents)
        # a row costs ten steps: only a draft almost sure to land pays, and a random drafter has none
        assert rounds and sum(len(out) for _, out in rounds) < sum(len(inner) for inner, _ in rounds)


@pytest.mark.parametrize("kind", ["eagle3-tree", "dspark-chain"])
def test_cheap_rows_cut_nothing(target, kind):
    proposer = MAKERS[kind](target)
    proposer.lookup.min_match = proposer.lookup.max_match  # copies only inside long loops: the drafter's round
    tokens, rounds = run(target, proposer, PROMPTS[0], CHEAP)
    assert tokens == plain_text(target, PROMPTS[0])
    assert rounds
    for inner, out in rounds:
        if out.tokens[:len(inner)].tolist() != inner.tokens.tolist():
            # a chain-only round may verify the copy instead: only where it expects more tokens
            assert proposer.chain_only and out.draft_probs is None and float(out.survival.sum()) > 0
        else:
            assert out.parents[:len(inner)].tolist() == inner.parents.tolist()


@pytest.mark.parametrize("kind", ["dflash-chain"])
def test_sampled_requests_are_not_sized_by_the_clock(target, kind):
    params = SamplingParams(temperature=0.9, top_k=5, seed=7)
    texts, drafted = [], []
    for cost in (EXPENSIVE, CHEAP):
        proposer = MAKERS[kind](target)
        tokens, rounds = run(target, proposer, LOOPY[0], cost, params)
        texts.append(tokens)
        drafted.append([out.tokens.tolist() for _, out in rounds])
        for inner, out in rounds:  # the drafter's whole proposal is verified, as without sizing
            assert out.tokens[:len(inner)].tolist() == inner.tokens.tolist() or proposer.chain_only
        assert not proposer.sizing.pending  # nothing recorded from sampled rounds
    assert texts[0] == texts[1] and drafted[0] == drafted[1]


def test_rounds_whose_sizing_does_not_pay_run_as_plain_steps(target):
    """Where a plain step costs next to nothing (a microsecond here), no accepted draft pays for
    sizing a round: after the first sized rounds, rounds run as plain steps (no drafter, no lookup)
    in gaps that double up to MAX_IDLE_SAMPLED, and the text is the seed's (temperature 1, seeded rule).
    Where a step costs a second, copies accepted in a greedy loop keep every round sized."""
    n = 96
    sampled = SamplingParams(temperature=1.0, seed=3)
    want = plain(target, [PROMPTS[0]], n, sampled)[0]
    proposer = MAKERS["eagle3-tree"](target)
    tokens, rounds = run(target, proposer, PROMPTS[0], (1e-6, 1e-7), sampled, n, idle=True, seeded_sampling="noise")
    assert tokens == want
    assert proposer.idle.gap == MAX_IDLE_SAMPLED
    assert len(rounds) < n // 4  # the drafter ran in few rounds
    proposer.idle.left = 0
    assert not proposer.idle.idle()
    proposer.idle.observe_sizing(1e-4, 1.0)  # a 1 s step (far above any sizing's measured time),
    proposer.idle.observe_accepted(3)  # and a round that accepts drafts: the next one is sized
    assert proposer.idle.gap == 2 and proposer.idle.left == 0 and not proposer.idle.idle()

    assert_sizes_every_round_of_a_loop(target, MAKERS["eagle3-tree"](target))


def test_what_the_idle_rule_learned_carries_to_the_next_request_sampled_alike():
    """A request at temperature 1 starts where the last one at temperature 1 left the idle rule; a
    greedy request starts from the greedy state (here: none, so afresh)."""
    hot, greedy = SamplingParams(temperature=1.0, seed=1), SamplingParams()
    idle = IdleRounds()
    idle.begin(hot)
    for _ in range(MIN_SIZED):
        assert not idle.idle()
        idle.observe_sizing(1e-3, 5e-3)
        idle.observe_accepted(0)
    assert idle.left > 0
    learned = (idle.accepted, idle.seconds, idle.gap, idle.rounds)
    idle.forget()  # the next request
    assert idle.rounds == 0 and idle.accepted is None
    idle.begin(greedy)
    assert idle.rounds == 0 and idle.accepted is None and idle.gap == 2
    idle.forget()
    idle.begin(SamplingParams(temperature=1.0, seed=7))  # another seed, the same settings
    assert (idle.accepted, idle.seconds, idle.gap, idle.rounds) == learned
    assert not idle.idle()  # its first round is sized, then the learned gap
    idle.observe_sizing(1e-3, 5e-3)
    idle.observe_accepted(0)
    assert idle.left == learned[2]
    idle.forget()
    idle.begin(SamplingParams(temperature=0.7, seed=1))
    assert idle.rounds == 0


@pytest.mark.parametrize("sampling, longest", [(SamplingParams(), MAX_IDLE),
                                                (SamplingParams(temperature=1.0, seed=1), MAX_IDLE_SAMPLED)])
def test_idle_gaps_stay_short_on_greedy_text(sampling, longest):
    """Greedy text copies again after stretches where nothing lands: its idle gaps stop at MAX_IDLE;
    a sampled request's grow to MAX_IDLE_SAMPLED."""
    idle = IdleRounds()
    idle.begin(sampling)
    gaps = []
    for _ in range(MIN_SIZED + 12):
        while idle.idle():
            pass
        idle.observe_sizing(1e-3, 5e-3)
        idle.observe_accepted(0)
        gaps.append(idle.left)
    assert max(gaps) == longest


def test_a_second_sampled_request_runs_fewer_sized_rounds_and_keeps_its_text(target):
    """Through `generate`: the second request at temperature 1 skips the re-learning, its text is
    still the seed's; a greedy request after them sizes every round of a loop that copies pay on."""
    n = 96
    sampled = SamplingParams(temperature=1.0, seed=3)
    want = plain(target, [PROMPTS[0]], n, sampled)[0]
    proposer = MAKERS["eagle3-tree"](target)
    first_tokens, first = run(target, proposer, PROMPTS[0], (1e-6, 1e-7), sampled, n, idle=True, seeded_sampling="noise")
    assert proposer.idle.rounds >= MIN_SIZED
    second_tokens, second = run(target, proposer, PROMPTS[0], (1e-6, 1e-7), sampled, n, idle=True, seeded_sampling="noise")
    assert first_tokens == second_tokens == want
    assert len(second) < len(first) // 2

    assert_sizes_every_round_of_a_loop(target, proposer)


def test_a_sized_round_pays_for_its_verify_rows_too():
    """Drafts accepted now and then pay for the sizing but not for the rows verified to get them:
    the round is slower than a plain step, so rounds idle. The same rounds verifying no extra rows
    (the verify costs a plain step) stay sized."""
    def rounds(verify_seconds: float) -> IdleRounds:
        idle = IdleRounds()
        for _ in range(MIN_SIZED):
            assert not idle.idle()
            idle.observe_sizing(1e-4, 5e-3)  # sizing 0.1 ms, a plain step 5 ms
            idle.observe_verify(verify_seconds)
            idle.observe_accepted(1 if _ % 10 == 9 else 0)  # a draft now and then: ~0.2 ms of plain steps
        return idle

    assert rounds(5e-3).left == 0
    slow = rounds(7e-3)  # each sized round's verify runs 2 ms past a plain step
    assert slow.left > 0 and slow.idle()
    slow.forget()
    assert slow.extra is None and slow.left == 0


def test_turning_the_cut_off_verifies_whole_proposals(target):
    """The benchmark's before/after switch: cost_cut False is the threshold rules alone."""
    proposer = MAKERS["dflash-chain"](target)
    proposer.cost_cut = False
    _, rounds = run(target, proposer, PROMPTS[0], EXPENSIVE)
    assert rounds == [] or all(len(out) >= len(inner) or out.draft_probs is None for inner, out in rounds)
    proposer.cost_cut = True
    _, cut = run(target, proposer, PROMPTS[0], EXPENSIVE)
    assert sum(len(o) for _, o in cut) < sum(len(i) for i, _ in cut)


def test_an_eagle3_chain_stops_drafting_where_depth_cannot_pay(target):
    proposer = MAKERS["eagle3-chain"](target)
    tokens, rounds = run(target, proposer, PROMPTS[0], EXPENSIVE)
    assert tokens == plain_text(target, PROMPTS[0])
    assert rounds and all(len(inner) <= 1 for inner, _ in rounds)  # one level, no deeper drafter call
    proposer.lookup.min_match = proposer.lookup.max_match
    _, rounds = run(target, proposer, PROMPTS[0], CHEAP)
    assert rounds and all(len(inner) == 4 for inner, _ in rounds)  # the whole depth, as without sizing


def random_tree(rng: random.Random, n: int) -> tuple[list[int], list[float]]:
    parents, survival = [], []
    for i in range(n):
        par = rng.randrange(-1, i)
        parents.append(par)
        above = 1.0 if par < 0 else survival[par]
        survival.append(above * rng.choice([rng.random(), 1.0]))  # ties with the parent happen too
    return parents, survival


def test_every_prefix_of_the_tree_order_is_closed_under_parents():
    rng = random.Random(0)
    for _ in range(200):
        parents, survival = random_tree(rng, rng.randrange(1, 20))
        order = tree_order(survival, parents)
        assert sorted(order) == list(range(len(parents)))
        taken: set[int] = set()
        for i in order:
            assert parents[i] < 0 or parents[i] in taken
            taken.add(i)
        # each node taken is the best the frontier offered
        frontier = {i for i, p in enumerate(parents) if p < 0}
        for i in order:
            assert survival[i] == max(survival[j] for j in frontier)
            frontier.remove(i)
            frontier |= {j for j, p in enumerate(parents) if p == i}


def test_a_sized_tree_is_a_valid_tree_of_the_best_nodes():
    rng = random.Random(1)
    for _ in range(100):
        parents, survival = random_tree(rng, rng.randrange(2, 16))
        tokens = torch.tensor([rng.randrange(50) for _ in parents])
        p = Proposal(tokens, torch.tensor(parents), None, False, 0, torch.tensor(survival))
        cost = (1.0, rng.choice([0.01, 0.1, 0.5]))
        out, rate, expected = sized(p, survival, cost)
        check_parents(out.parents)
        # the kept nodes are the first len(out) of the tree order, in p's order, with their tokens
        keep = sorted(tree_order(survival, parents)[:len(out)])
        assert out.tokens.tolist() == [int(tokens[i]) for i in keep]
        assert expected == pytest.approx(1 + sum(survival[i] for i in keep))
        # no other size of the order does better
        order = tree_order(survival, parents)
        for n in range(len(parents) + 1):
            e = 1 + sum(survival[i] for i in order[:n])
            assert e / (cost[0] + cost[1] * (1 + n)) <= rate + 1e-12


def test_the_record_starts_from_the_drafters_own_confidence_and_learns():
    record = DraftRecord()
    assert record.rate(1, 0.8) == pytest.approx(0.8)
    for _ in range(50):  # a confident first draft that never lands
        record.record([5], [-1], [0.8], [6])
    assert record.rate(1, 0.8) < 0.15
    assert record.rate(2, 0.8) == pytest.approx(0.8)  # other depths keep their own evidence
    # the second draft is scored only where the first landed
    record.record([5, 7], [-1, 0], [0.5, 0.5], [6, 7])
    assert record.rate(2, 0.5) == pytest.approx(0.5)


def test_a_drafter_slower_than_the_copies_is_skipped_but_asked_again():
    sizing = VerifyLength()
    sizing.observe_draft(0.010)
    sizing.observe_round(1.2, 3)  # the drafter's rounds: 1.2 tokens for 10 ms + 3 rows
    cost = (0.007, 0.001)
    plain_rate = 1 / 0.008
    skipped = [sizing.should_skip(cost, plain_rate) for _ in range(24 + 200)]
    asked = [i for i, s in enumerate(skipped) if not s]
    # asked after 8 skipped rounds, then after twice as many each time it still does not pay, at most 64
    assert asked[:4] == [7, 23, 55, 119] and asked[4] - asked[3] == 64
    sizing.observe_round(20.0, 3)
    assert sizing.should_skip(cost, plain_rate) is False  # it pays: asked at once, and the gap starts over
    for _ in range(30):  # and stops paying again
        sizing.observe_round(0.0, 3)
    assert [sizing.should_skip(cost, plain_rate) for _ in range(8)].count(False) == 1


def test_auto_shares_one_step_cost_between_its_arms(target):
    copies = LookupProposer(max_tokens=5)
    drafter = WithLookup(eagle3(target, top_k=1), max_tokens=5)
    auto = AutoProposer(copies, drafter)
    assert drafter.step_cost is copies.step_cost and drafter.lookup is copies.lookup
    result = generate_speculative(TorchTargetEngine(target, 256, 1), auto, [LOOPY[0]], N, SamplingParams())
    assert result.tokens == [plain_text(target, LOOPY[0])]
