"""The copy datastore (`specrt.runtime.proposers.datastore`) and the measured step cost
(`step_cost.py`): what the store answers, that it round-trips and refuses a bad file, that copies from
it keep speculation lossless and are accepted where the target repeats other requests' text, and that
the lookup's copy length follows the measured cost."""

from __future__ import annotations

import random

import numpy as np
import pytest
from specrt.plugins.errors import SpecrtError
from specrt.runtime.backends.torch_backend import TorchTargetEngine
from specrt.runtime.proposers.datastore import NgramDatastore, _hash_suffixes, load_datastore_for, store_key
from specrt.runtime.proposers.lookup import LookupProposer, NgramLookup
from specrt.tools.copy_files import replay_hits
from specrt.runtime.proposers.step_cost import StepCost, best_length
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import generate_speculative
from test_speculative import PROMPTS, VOCAB, plain, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_the_longest_stored_suffix_gives_its_most_frequent_next_token():
    store = NgramDatastore.build([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4], [7, 8], [7, 9]], max_match=4)
    assert store.next_token([9, 1, 2, 3]) == (4, 3)  # (1, 2, 3) -> 4 twice, 5 once; (9, 1, 2, 3) unseen
    assert store.next_token([7]) == (8, 1)  # a tie goes to the smaller id: builds are deterministic
    assert store.next_token([42]) == (-1, 0)
    assert store.next_token([4, 7]) == (8, 1)  # no n-gram spans two sequences: (4, 7) was never stored
    assert store.chain([1, 2], 8) == ([3, 4], 2)  # walks on while matches are >= min_continue long
    # the runtime's suffix hashes are the build's keys
    assert set(_hash_suffixes([1, 2, 3], 3).tolist()) <= set(store.keys.tolist())


def test_a_store_round_trips_and_a_bad_file_is_refused(tmp_path):
    store = NgramDatastore.build([[5, 6, 7, 8, 5, 6]], max_match=3, meta={"source": "test"})
    path = store.save(tmp_path / "datastore.npz")
    again = NgramDatastore.load(path)
    assert np.array_equal(again.keys, store.keys) and np.array_equal(again.next_tokens, store.next_tokens)
    assert again.max_match == 3 and again.meta["source"] == "test" and again.chain([5], 4) == store.chain([5], 4)
    path.write_bytes(b"not a zip file")
    with pytest.raises(SpecrtError, match="cannot read the copy datastore"):
        NgramDatastore.load(path)
    with pytest.raises(SpecrtError, match="no token sequences"):
        NgramDatastore.build([[1]])
    store.save(path)
    with pytest.raises(SpecrtError, match="another vocabulary"):
        load_datastore_for(tmp_path, vocab_size=8)  # it proposes token 8: not in an 8-token vocabulary
    assert len(load_datastore_for(tmp_path, vocab_size=9)) == len(store)


def test_copies_from_a_store_of_other_answers_are_lossless_and_accepted(target):
    """The store holds the target's greedy answers to the same prompts (as a store of earlier
    requests would): its copies are right, and speculation still equals plain decoding. A store of
    random text proposes wrong copies, which verification rejects: output unchanged."""
    answers = plain(target, PROMPTS, 40)
    store = NgramDatastore.build([list(p) + list(a) for p, a in zip(PROMPTS, answers)])
    rng = random.Random(0)
    noise = NgramDatastore.build([[rng.randrange(VOCAB) for _ in range(200)] for _ in range(5)])

    def run(datastore):
        proposer = LookupProposer(max_tokens=6, threshold=0.0, datastore=datastore, free_first=True)
        result = [generate_speculative(TorchTargetEngine(target, 128), proposer, [p], 40, SamplingParams())
                  for p in PROMPTS]
        tau = sum(r.stats[0].new_tokens - 1 for r in result) / sum(r.stats[0].rounds for r in result)
        return [r.tokens[0] for r in result], tau

    own_tokens, own_tau = run(None)
    store_tokens, store_tau = run(store)
    noise_tokens, _ = run(noise)
    assert own_tokens == store_tokens == noise_tokens == answers
    assert store_tau > own_tau + 1.0, (store_tau, own_tau)


def test_free_first_verifies_one_copy_whatever_its_odds():
    lookup = NgramLookup(max_tokens=4, threshold=0.9, free_first=False)
    lookup.reset(1)
    lookup.observe([0], [[3, 4, 5, 3]], [4])  # history 3 4 5 3 4: "3 4" was followed by 5
    assert lookup.chain(0).tokens == []  # a Beta(1, 1) rate of .5 is below the threshold
    lookup.free_first = True
    assert lookup.chain(0).tokens == [5]


def test_replay_counts_store_copies_in_their_own_cells():
    store = NgramDatastore.build([[1, 2, 3, 4, 5, 6]])
    prior = replay_hits([([9], [1, 2, 3, 4, 5, 6, 7])], datastore=store)
    assert store_key(1) in prior.trials and prior.hits[store_key(1)][0] == 1  # "1" -> 2: right
    assert all(k < 0 for k in prior.trials)  # the response never repeats itself: no own-text cells


def test_the_step_cost_line_and_the_length_it_chooses():
    cost = StepCost(min_samples=3)
    for _ in range(3):
        cost.observe(1, 2, 0.006)
    assert cost.line() is None  # one T seen: no slope yet
    for _ in range(3):
        cost.observe(1, 5, 0.009)
    c0, c1 = cost.line()
    assert c0 == pytest.approx(0.004) and c1 == pytest.approx(0.001)
    assert cost.line(batch=2) is None  # costs are kept per batch size
    # (1 + .9 + .8) / 7 beats (1 + .9) / 6 and (1 + .9 + .8 + .1) / 8
    assert best_length([0.9, 0.8, 0.1], (4.0, 1.0)) == (2, pytest.approx(2.7 / 7))
    assert best_length([0.1], (4.0, 1.0))[0] == 0 and best_length([0.1], (4.0, 1.0), free_first=True)[0] == 1
    # sizing a second branch: the step already holds 3 rows expecting 2.5 tokens
    assert best_length([0.5, 0.1], (4.0, 1.0), expected=2.5, rows=3)[0] == 1


def _measured_line(cost: StepCost, ts=(1, 2, 4, 8, 16), rounds: int = 10) -> None:
    for _ in range(rounds):
        for t in ts:
            cost.observe(1, t, (4.0 + t) / 1000)  # 4 ms + 1 ms a row


def test_one_stall_does_not_lock_the_step_cost_line():
    """A stall taken at face value inflated its T's mean, the slope cut drafts short, and the T was never
    measured again to correct it: a stall now counts as twice the expected time, no more."""
    cost = StepCost()
    _measured_line(cost)
    assert cost.line() == pytest.approx((0.004, 0.001))
    cost.observe(1, 16, 0.5)  # half a second on the longest verify
    c0, c1 = cost.line()
    assert c1 == pytest.approx(0.001, rel=0.2) and c0 == pytest.approx(0.004, rel=0.2)  # unclipped: c1 ~4x
    assert cost.mean[(1, 16)] == pytest.approx(0.9 * 0.020 + 0.1 * 0.040)
    cost.observe(1, 12, 0.5)  # a T not measured before: clipped against the line's prediction (16 ms)
    assert 0.030 < cost.mean[(1, 12)] < 0.036  # twice the ~16 ms the line predicts


def test_a_length_no_longer_verified_stops_steering_the_line():
    """A lasting slowdown of long verifies comes through (clipped samples still move the mean); once
    that T is no longer verified, the line is fitted to the T's still measured."""
    cost = StepCost(stale_after=100)
    _measured_line(cost)
    for _ in range(10):
        cost.observe(1, 16, 0.5)
    line = cost.line()
    assert cost.mean[(1, 16)] > 0.05 and (line is None or line[1] > 0.002)  # long verifies look expensive
    for _ in range(60):
        for t in (1, 2):
            cost.observe(1, t, (4.0 + t) / 1000)
    assert cost.line() == pytest.approx((0.004, 0.001))  # T = 16 measured 120 steps ago: left out


def test_two_disagreeing_copies_are_verified_as_two_branches_losslessly(target):
    """tree=True: where the request's own text and the store propose different next tokens, both are
    verified (a tree); greedy output still equals plain decoding, and some step verified a tree."""
    answers = plain(target, PROMPTS, 40)
    rng = random.Random(1)
    # half right (the answers), half noise: the two sources disagree often
    store = NgramDatastore.build([list(a) for a in answers[:2]] + [[rng.randrange(VOCAB) for _ in range(100)]])
    proposer = LookupProposer(max_tokens=6, threshold=0.0, datastore=store, tree=True)
    trees = []
    original = proposer.propose

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        trees.extend(not p.is_chain for p in out)
        return out

    proposer.propose = spy
    got = [generate_speculative(TorchTargetEngine(target, 128), proposer, [p], 40, SamplingParams()).tokens[0]
           for p in PROMPTS]
    assert got == answers and any(trees)
