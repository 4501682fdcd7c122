"""Drafts copied from the request's own text (`specrt.runtime.proposers.lookup`): the index finds the
longest earlier match, grafting keeps the drafter's tree intact, and speculation with copies stays
lossless (greedy equals plain decoding, sampling keeps the target's distribution) alone, grafted onto
every drafter kind, batched and served."""

from __future__ import annotations

import pytest
import torch

from specrt.plugins.errors import SpecrtError
from specrt.runtime.backends.torch_backend import TorchTargetEngine
from specrt.runtime.proposers.base import Proposal
from specrt.export.draft_options import DraftOptions
from specrt.runtime.proposers.factory import load_proposer, proposer_for
from specrt.runtime.proposers.lookup import (
    HitRecord,
    LookupChain,
    LookupProposer,
    NgramIndex,
    NgramLookup,
    WithLookup,
    graft_chain,
    graft_tree,
    record_key,
)
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import generate_speculative
from specrt.runtime.tree import check_parents, node_depths
from test_speculative import (
    PROMPTS,
    block,
    chi_square_pvalue,
    eagle3,
    exact_first_tokens,
    plain,
    sampled,
    small_target,  # noqa: F401  (a fixture: spread-out distributions, so sampling matters)
    tiny_target,
)

# a prompt that repeats itself, so copies have something to find from the first step
LOOPY = [[4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23, 42, 4, 8], [7, 7, 7, 7, 7], [1, 2, 3, 9, 1, 2, 3, 9, 1]]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


# ---------------------------------------------------------------------------------------------- index


def test_the_longest_most_recent_match_is_continued():
    index = NgramIndex(max_match=4)
    index.extend([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3])
    # "1 2 3" occurred before (followed by 9); "2 3" more recently (followed by 7): the longer wins
    assert index.continuation(3, 1) == ([9, 5, 2], 3)
    index = NgramIndex(max_match=2)
    index.extend([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3])
    assert index.continuation(2, 1) == ([7, 1], 2)  # capped at 2: the most recent "2 3"


def test_a_copy_that_runs_into_the_present_repeats_the_loop():
    index = NgramIndex(max_match=8)
    index.extend([5, 1, 2, 1, 2])
    # "1 2" was followed by "1 2"; past the end the copy reads its own tokens: period 2 continues
    tokens, match = index.continuation(7, 1)
    assert tokens == [1, 2, 1, 2, 1, 2, 1] and match == 2  # "1 2" was last followed by "1 2"


def test_no_match_and_min_match():
    index = NgramIndex(max_match=4)
    index.extend([1, 2, 3, 4])
    assert index.continuation(4, 1) == ([], 0)
    index.extend([9, 4])
    assert index.continuation(2, 1) == ([9, 4], 1)
    assert index.continuation(2, 2) == ([], 0)  # only a 1-token match exists


def test_hit_record_rates_are_conditional_and_survival_never_grows():
    record = HitRecord()
    assert record.rate(3, 1) == 0.5  # the prior
    record.record(2, [5, 6, 7], [5, 6, 9])  # depth 1, 2 right, depth 3 wrong
    record.record(2, [5, 6], [4, 6])  # depth 1 wrong: depth 2 is not scored
    assert record.trials[2] == [2, 1, 1] and record.hits[2] == [1, 1, 0]
    assert record.rate(2, 1) == pytest.approx(2 / 4) and record.rate(2, 2) == pytest.approx(2 / 3)
    s = record.survival(2, 4, start=0.9)
    assert all(a >= b for a, b in zip(s, s[1:])) and s[0] <= 0.9


def test_the_threshold_cuts_the_copy_and_the_record_scores_all_of_it():
    lookup = NgramLookup(max_tokens=6, threshold=0.3)
    lookup.reset(1)
    lookup.observe([0], [[3, 1, 2, 3, 1, 2]], [3])
    chain = lookup.chain(0)
    # prior .5 per depth: .5, .25 -> one copy passes the threshold of .3
    assert chain.tokens == [1] and chain.survival == [0.5]
    lookup.observe([0], [[3]], [1])  # the target emitted 1 (the copy's first), then it stops
    assert lookup.record.trials[chain.match][:2] == [1] and lookup.record.hits[chain.match][0] == 1
    with pytest.raises(SpecrtError, match="--lookup-threshold"):
        NgramLookup(threshold=1.5)
    with pytest.raises(SpecrtError, match="--lookup"):
        NgramLookup(max_tokens=0)


# ---------------------------------------------------------------------------------------------- grafting


def _paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    out = set()
    for i in range(len(tokens)):
        path, node = [], i
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        out.add(tuple(reversed(path)))
    return out


def test_sampled_requests_continue_the_copy_record_of_requests_sampled_alike():
    """What a request sampled at temperature 1 learns about copies carries to the next one sampled
    alike; greedy requests, other settings and seeds that drive rejection sampling start afresh."""
    proposer = LookupProposer()

    def record_of(sampling, seeded_sampling="noise"):
        proposer.reset(1, 64)
        proposer.begin_request(sampling, seeded_sampling)
        return proposer.lookup.record

    first = record_of(SamplingParams(1.0, seed=3))
    first.record(4, [5, 6], [5, 7])  # one hit, one miss
    again = record_of(SamplingParams(1.0, seed=9))
    assert again is first and again.trials[4] == [1, 1] and again.hits[4] == [1, 0]
    assert record_of(SamplingParams(1.0)) is first  # unseeded: nothing a seed drives
    for fresh in (record_of(SamplingParams()), record_of(SamplingParams(0.7, seed=3)),
                  record_of(SamplingParams(1.0, seed=3), "stream")):
        assert fresh is not first and not fresh.trials
    assert record_key(SamplingParams(0.7, top_k=20, seed=1)) == (0.7, 20, 1.0)


def test_graft_tree_reuses_the_drafters_nodes_and_adds_the_rest_as_a_branch():
    # anchor -> 5 -> 6, anchor -> 7
    p = Proposal(torch.tensor([5, 7, 6]), torch.tensor([-1, -1, 0]), None, False, 2, torch.tensor([.6, .3, .4]))
    chain = LookupChain([5, 6, 8, 9], 3, [.9, .8, .7, .6])
    g = graft_tree(p, chain)
    tokens, parents = g.tokens.tolist(), g.parents.tolist()
    check_parents(parents)
    assert tokens[:3] == [5, 7, 6] and parents[:3] == [-1, -1, 0]  # the drafter's tree is untouched
    assert _paths(tokens, parents) == _paths([5, 7, 6], [-1, -1, 0]) | {(5, 6, 8), (5, 6, 8, 9)}
    assert len(tokens) == 5 and g.depth == 4 and not g.is_chain
    s = g.survival.tolist()
    for i, par in enumerate(parents):
        if par >= 0:
            assert s[i] <= s[par] + 1e-7  # never increasing along a path
    assert graft_tree(p, LookupChain([], 0, [])) is p
    assert graft_tree(p, LookupChain([5, 6], 2, [.9, .8])) is p  # nothing new to verify


def test_graft_tree_gives_copies_point_mass_rows_beside_sampled_drafts():
    vocab = 11
    q = torch.softmax(torch.randn(2, vocab), -1)
    p = Proposal.chain(torch.tensor([3, 4]), q)
    g = graft_tree(p, LookupChain([3, 9], 1, [.9, .8]))
    assert g.tokens.tolist() == [3, 4, 9] and g.parents.tolist() == [-1, 0, 0]
    assert torch.equal(g.draft_probs[:2], q)
    assert g.draft_probs[2].tolist() == [1.0 if i == 9 else 0.0 for i in range(vocab)]
    extended = graft_tree(p, LookupChain([3, 4, 5], 1, [.9, .8, .7]))  # continues the chain: still a chain
    assert extended.is_chain and extended.tokens.tolist() == [3, 4, 5]


def test_graft_chain_keeps_whichever_chain_expects_more():
    p = Proposal.chain(torch.tensor([3, 4]), None, torch.tensor([.9, .8]))
    assert graft_chain(p, LookupChain([7, 8, 9], 4, [.5, .4, .3])) is p  # 1.2 < 1.7
    g = graft_chain(p, LookupChain([7, 8, 9], 6, [.95, .9, .85]))
    assert g.is_chain and g.tokens.tolist() == [7, 8, 9] and g.draft_probs is None
    sampled_chain = Proposal.chain(torch.tensor([3]), torch.full((1, 5), 0.2), torch.tensor([.2]))
    assert graft_chain(sampled_chain, LookupChain([1, 2], 6, [.9, .9])).draft_probs is None


# ---------------------------------------------------------------------------------------------- losslessness

MAKERS = {
    "lookup": lambda t: LookupProposer(max_tokens=6, threshold=0.0),
    "lookup-gated": lambda t: LookupProposer(max_tokens=6),
    "eagle3+lookup": lambda t: WithLookup(eagle3(t), max_tokens=5, threshold=0.0),
    "eagle3-chain+lookup": lambda t: WithLookup(eagle3(t, top_k=1), max_tokens=5, threshold=0.0),
    "dflash+lookup": lambda t: WithLookup(block(t, "dflash"), max_tokens=5, threshold=0.0),
    "dspark+lookup": lambda t: WithLookup(block(t, "dspark", threshold=0.2), max_tokens=5, alone_above=0.3),
    "dspark-chain-only+lookup": lambda t: WithLookup(block(t, "dspark"), max_tokens=5, threshold=0.0,
                                                     chain_only=True),
}


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "batch3"])
def test_greedy_with_copies_equals_plain_decoding(target, kind, batched):
    proposer = MAKERS[kind](target)
    for prompts in (PROMPTS, LOOPY):
        expected = plain(target, prompts, 40)
        if batched:
            got = generate_speculative(TorchTargetEngine(target, 128, len(prompts)), proposer, prompts, 40,
                                       SamplingParams()).tokens
        else:
            got = [generate_speculative(TorchTargetEngine(target, 128), proposer, [p], 40, SamplingParams()).tokens[0]
                   for p in prompts]
        assert got == expected


def test_copies_are_accepted_when_the_target_repeats(target):
    """The tiny target falls into loops: copying pays there (tau well above 1 with copies alone)."""
    result = generate_speculative(TorchTargetEngine(target, 256, len(LOOPY)), LookupProposer(max_tokens=8),
                                  LOOPY, 100, SamplingParams())
    assert result.tokens == plain(target, LOOPY, 100)
    rounds = sum(s.rounds for s in result.stats)
    tau = sum(s.new_tokens - 1 for s in result.stats) / rounds
    assert tau > 1.5, tau


@pytest.mark.parametrize("kind", ["lookup", "eagle3+lookup", "dflash+lookup"])
def test_sampling_with_copies_keeps_the_target_distribution(small_target, kind):  # noqa: F811
    params = SamplingParams(temperature=0.9, top_k=5, seed=1234)
    prompt = [1, 4, 1, 4, 1]  # repeats: the copy proposes from the first step
    proposer = {"lookup": lambda: LookupProposer(max_tokens=3, threshold=0.0),
                "eagle3+lookup": lambda: WithLookup(eagle3(small_target), max_tokens=3, threshold=0.0),
                "dflash+lookup": lambda: WithLookup(block(small_target, "dflash", threshold=0.05), max_tokens=3,
                                                    threshold=0.0)}[kind]()
    exact = exact_first_tokens(small_target, prompt, params, 3)
    assert chi_square_pvalue(sampled(small_target, proposer, prompt, params, 3), exact, 3) > 1e-3


def test_the_sampling_test_catches_copies_accepted_without_the_test(small_target, monkeypatch):  # noqa: F811
    import specrt.runtime.step as loop

    def accept_everything(tokens, draft_probs, target_probs, generator=None):
        k = int(tokens.shape[0])
        return k, int(torch.multinomial(target_probs[k].float(), 1, generator=generator))

    monkeypatch.setattr(loop, "verify_chain_sampling", accept_everything)
    params = SamplingParams(temperature=0.9, top_k=5, seed=1234)
    prompt = [1, 4, 1, 4, 1]
    exact = exact_first_tokens(small_target, prompt, params, 3)
    got = sampled(small_target, LookupProposer(max_tokens=3, threshold=0.0), prompt, params, 3)
    assert chi_square_pvalue(got, exact, 3) < 1e-6


# ---------------------------------------------------------------------------------------------- wiring


def test_options_build_grafted_and_drafter_free_proposers(target):
    options = DraftOptions(lookup=7, lookup_threshold=0.2)
    p = load_proposer("lookup", None, target, options)
    assert isinstance(p, LookupProposer) and p.max_drafts == 7 and p.tap_layers == ()
    inner = eagle3(target)
    wrapped = proposer_for("eagle3", inner.drafter, options)
    assert isinstance(wrapped, WithLookup) and wrapped.name == "eagle3+lookup"
    assert wrapped.max_drafts == wrapped.inner.max_drafts + 7
    assert not isinstance(proposer_for("eagle3", inner.drafter, DraftOptions(lookup=0)), WithLookup)
    assert isinstance(proposer_for("eagle3", inner.drafter, DraftOptions()), WithLookup)  # copies on by default
    with pytest.raises(SpecrtError, match="--lookup"):
        DraftOptions(lookup=-1)
    with pytest.raises(SpecrtError, match="match"):
        DraftOptions(lookup=4, lookup_min_match=3, lookup_max_match=2)


def test_a_skipped_drafter_still_sees_every_committed_token(target):
    """When a confident copy is verified alone the drafter neither drafts nor ingests: its committed
    tokens wait in the backlog and are ingested at once before it next drafts, so every draft comes
    from the full context (greedy output stays plain decoding's)."""
    calls = {"propose": 0, "observe": 0}
    inner = eagle3(target)
    original_propose, original_observe = inner.propose, inner.observe

    def counting_propose(rows, *args):
        calls["propose"] += 1
        return original_propose(rows, *args)

    def counting_observe(rows, *args):
        calls["observe"] += 1
        return original_observe(rows, *args)

    inner.propose, inner.observe = counting_propose, counting_observe
    proposer = WithLookup(inner, max_tokens=6, threshold=0.0, alone_above=0.0)  # always alone once matched
    result = generate_speculative(TorchTargetEngine(target, 256, len(LOOPY)), proposer, LOOPY, 60, SamplingParams())
    assert result.tokens == plain(target, LOOPY, 60)
    steps = max(s.rounds for s in result.stats)
    assert calls["propose"] < steps  # some steps did skip the drafter
    assert calls["observe"] <= calls["propose"] + 1  # one call per drafting round (and the prompts)
    context = [proposer.context_length(b) for b in range(len(LOOPY))]
    assert context != [inner.context_length(b) for b in range(len(LOOPY))]  # the last rounds are held
    proposer.backlog.catch_up()
    assert [inner.context_length(b) for b in range(len(LOOPY))] == context


def test_serving_batches_with_copies_equal_each_request_alone(target):
    from specrt.runtime.serving.batcher import Batcher, Request
    from test_serving_batcher import ARRIVALS, MAX_NEW, SPS, drive
    from test_serving_batcher import PROMPTS as SERVE_PROMPTS

    prompts = SERVE_PROMPTS[:3] + LOOPY
    alone = [plain(target, [p], n)[0] for p, n in zip(prompts, MAX_NEW)]
    for schedule in ("fixed", "confidence"):
        proposer = WithLookup(block(target, "dspark", threshold=0.2), max_tokens=5, threshold=0.0)
        batcher = Batcher(TorchTargetEngine(target, 128, 3), proposer, schedule, SPS, draft_gate=False)
        requests = [Request(p, n) for p, n in zip(prompts, MAX_NEW)]
        drive(batcher, requests, ARRIVALS)
        assert [r.tokens for r in requests] == alone
        assert batcher.free_rows == 3 and not batcher.running


def test_depths_of_grafted_trees_match_their_verify_positions():
    p = Proposal(torch.tensor([5, 7]), torch.tensor([-1, -1]), None, False, 1, None)
    g = graft_tree(p, LookupChain([7, 2, 3], 2, [.9, .9, .9]))
    assert list(node_depths(g.parents)) == [1, 1, 2, 3] and g.survival is None


def test_replayed_hit_counts_follow_the_live_record_and_round_trip(tmp_path):
    from specrt.runtime.proposers.lookup import HitRecord
    from specrt.runtime.proposers.lookup_prior import LookupPrior
    from specrt.tools.copy_files import replay_hits

    # a response that loops "1 2 3": after the first period every copy is right
    prior = replay_hits([([9, 1, 2, 3], [1, 2, 3, 1, 2, 3, 1, 2, 3, 7])], max_tokens=4)
    assert prior.meta["steps"] >= 1 and prior.trials
    long = max(prior.trials)
    assert prior.rate(long, 1) > 0.5  # loops are right more often than not
    # a seeded record starts at the prior's rate and moves toward what it sees
    record = HitRecord(prior=prior)
    assert record.rate(long, 1) == pytest.approx(prior.rate(long, 1))
    for _ in range(200):
        record.record(long, [5], [6])  # always wrong
    assert record.rate(long, 1) < 0.1
    path = prior.save(tmp_path / "lookup.json")
    again = LookupPrior.load(path)
    assert again.trials == prior.trials and again.hits == prior.hits
    path.write_text('{"format": "specrt-lookup-prior/1", "trials": {"1": [3]}, "hits": {"1": [5]}}')
    with pytest.raises(SpecrtError, match="more hits than trials"):
        LookupPrior.load(path)


def test_a_closed_draft_gate_still_verifies_copies_losslessly(target):
    from specrt.runtime.serving.batcher import Batcher, Request
    from specrt.runtime.serving.policy import DraftGate
    from test_serving_batcher import ARRIVALS, MAX_NEW, SPS, drive
    from test_serving_batcher import PROMPTS as SERVE_PROMPTS

    class ShutGate(DraftGate):  # the drafter never pays: only the copies are verified
        def should_draft(self) -> bool:
            return False

    prompts = SERVE_PROMPTS[:3] + LOOPY
    alone = [plain(target, [p], n)[0] for p, n in zip(prompts, MAX_NEW)]
    proposer = WithLookup(block(target, "dspark", threshold=0.2), max_tokens=5, threshold=0.0)
    batcher = Batcher(TorchTargetEngine(target, 128, 3), proposer, "confidence", SPS, measured_gate=False)
    batcher.gate = ShutGate()
    requests = [Request(p, n) for p, n in zip(prompts, MAX_NEW)]
    drive(batcher, requests, ARRIVALS)
    assert [r.tokens for r in requests] == alone
    c = batcher.counters
    assert c.draft_steps == 0 and c.copy_steps == c.steps and c.accepted_drafts > 0
    assert batcher.free_rows == 3 and not batcher.running
