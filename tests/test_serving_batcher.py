"""Continuous batching on the torch backend: every request's greedy output equals its output alone,
whatever joins or leaves around it; rows are reused; sampling keeps the target's distribution."""

from __future__ import annotations

import pytest
import torch
from specrt.runtime.backends.torch_backend import TorchTargetEngine
from specrt.runtime.generate import generate_autoregressive
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import SpsTable
from specrt.runtime.serving.batcher import Batcher, Request
from specrt.runtime.serving.rows import proposer_prefix_view, reset_engine_row, row_view, runs
from test_speculative import OracleProposer, block, chi_square_pvalue, eagle3, exact_first_tokens, tiny_target

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 9, 13, 2, 7, 40], [11, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7], [30, 31, 32, 33],
           [50, 2, 2, 8]]
MAX_NEW = [20, 33, 7, 25, 1, 18]
ARRIVALS = {0: [0, 1], 2: [2, 3], 3: [4], 6: [5]}  # step -> requests joining before it
# step time affine in the token positions: drafting pays only for likely drafts
SPS = SpsTable(list(range(1, 513)), [1.0 / (1.0 + 0.03 * b) for b in range(1, 513)])

KINDS = {
    "none": lambda t: None,
    "eagle3": lambda t: eagle3(t),
    "dflash": lambda t: block(t, "dflash"),
    "dspark": lambda t: block(t, "dspark", threshold=0.2),
}


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def alone(target):
    """Each request decoded alone, plainly: the reference every batched run must reproduce."""
    return [generate_autoregressive(TorchTargetEngine(target, 128), [p], n, SamplingParams()).tokens[0]
            for p, n in zip(PROMPTS, MAX_NEW)]


def drive(batcher: Batcher, requests: list[Request], arrivals=ARRIVALS, max_steps: int = 500) -> int:
    """Requests join before the steps `arrivals` names; returns the number of steps run."""
    for step in range(max_steps):
        for i in arrivals.get(step, []):
            batcher.add(requests[i])
        busy = batcher.step()
        if not busy and step > max(arrivals):
            return step
    raise AssertionError("the batcher did not finish")


@pytest.mark.parametrize("schedule", ["fixed", "confidence"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_batched_equals_alone(target, alone, kind, schedule):
    slots = 3  # 6 requests through 3 rows: rows are freed and reused
    # gates off: every step drafts, so the scheduler's cuts (chains and trees) are what gets verified
    batcher = Batcher(TorchTargetEngine(target, 128, slots), KINDS[kind](target), schedule, SPS, draft_gate=False,
                      measured_gate=False)
    requests = [Request(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    drive(batcher, requests)
    assert [r.tokens for r in requests] == alone
    assert [r.finish_reason for r in requests] == ["length"] * len(requests)
    assert batcher.free_rows == slots and not batcher.running
    assert sorted({r.row for r in requests}) == [0, 1, 2]
    assert int(batcher.engine.lengths.sum()) == 0  # freed rows do not widen the attention window
    c = batcher.counters
    if kind != "none":
        assert c.draft_steps == c.steps and 0 < c.verify_drafts <= c.proposed_drafts
    if kind in ("eagle3", "dspark") and schedule == "confidence":
        assert c.verify_drafts < c.proposed_drafts  # Algorithm 1 cut some proposals short


def test_oracle_drafts_are_accepted_under_batching(target, alone):
    """A perfect drafter: every draft verified is accepted, with rows of different lengths in one step."""
    longer = [generate_autoregressive(TorchTargetEngine(target, 128), [p], n + 8, SamplingParams()).tokens[0]
              for p, n in zip(PROMPTS, MAX_NEW)]
    oracle = OracleProposer(longer, [len(p) for p in PROMPTS], k=4, tree=True)
    batcher = Batcher(TorchTargetEngine(target, 128, 6), oracle)
    requests = [Request(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    # the oracle indexes its continuations by row: admit request i into row i
    for r in requests:
        batcher.add(r)
    batcher.run_until_done()
    assert [r.tokens for r in requests] == alone
    c = batcher.counters
    assert c.accepted_drafts > 0 and c.emitted > c.row_steps  # more than one token per row-step


def test_cancel_frees_the_row_and_leaves_the_others_alone(target, alone):
    batcher = Batcher(TorchTargetEngine(target, 128, 2), block(target, "dflash"))
    requests = [Request(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    victim = Request([3, 4, 5], 60)
    batcher.add(victim)
    batcher.add(requests[1])
    for _ in range(3):
        batcher.step()
    assert not victim.done and len(victim.tokens) > 1
    batcher.cancel(victim)
    batcher.add(requests[0])  # takes the victim's row on the next step
    batcher.step()
    assert victim.finish_reason == "cancelled" and requests[0].row == victim.row
    batcher.run_until_done()
    assert requests[0].tokens == alone[0] and requests[1].tokens == alone[1]
    assert batcher.free_rows == 2
    waiting = Request([1, 2], 5)
    batcher.add(waiting)
    batcher.cancel(waiting)  # cancelled before it got a row
    batcher.step()
    assert waiting.finish_reason == "cancelled" and waiting.tokens == [] and batcher.free_rows == 2


def test_stop_ids_eos_and_a_full_cache(target, alone):
    stop = alone[1][5]
    capacity = 24
    engine = TorchTargetEngine(target, capacity, 3)
    batcher = Batcher(engine, block(target, "dspark"), eos_token_ids=[alone[0][3]])
    by_stop = Request(PROMPTS[1], 30, stop_token_ids=(stop,))
    by_eos = Request(PROMPTS[0], 30)
    ignoring = Request(PROMPTS[0], 10, ignore_eos=True)
    full = Request(PROMPTS[2], 100, ignore_eos=True)  # 13 prompt tokens in a 24-slot row
    for r in (by_stop, by_eos, ignoring, full):
        batcher.add(r)
    batcher.run_until_done()
    assert by_stop.tokens == alone[1][: alone[1].index(stop) + 1] and by_stop.finish_reason == "eos"
    assert by_eos.tokens == alone[0][:4] and by_eos.finish_reason == "eos"
    assert ignoring.tokens == alone[0][:10] and ignoring.finish_reason == "length"
    assert full.finish_reason == "cache_full" and len(PROMPTS[2]) + len(full.tokens) == capacity
    ref = generate_autoregressive(TorchTargetEngine(target, 128), [PROMPTS[2]], len(full.tokens), SamplingParams())
    assert full.tokens == ref.tokens[0]


def test_bad_requests_are_refused(target):
    from specrt.plugins.errors import SpecrtError

    batcher = Batcher(TorchTargetEngine(target, 32, 2))
    for bad, words in [(Request([], 4), "empty prompt"), (Request([1] * 32, 4), "KV cache holds 32"),
                       (Request([1, 999], 4), "outside the vocabulary"), (Request([1], 0), "max_tokens")]:
        with pytest.raises(SpecrtError, match=words):
            batcher.add(bad)
    assert batcher.idle
    with pytest.raises(SpecrtError, match="SPS table"):
        Batcher(TorchTargetEngine(target, 32, 2), block(target, "dflash"), "confidence", None)


class ProtocolOnlyEngine:
    """The TargetEngine protocol and nothing else (no cache attributes): the batcher cannot take row
    views and must fall back to whole-batch steps."""

    def __init__(self, inner: TorchTargetEngine) -> None:
        self._inner = inner
        self.config, self.capacity, self.spare_slots = inner.config, inner.capacity, inner.spare_slots
        self.calls = 0

    @property
    def batch_size(self):
        return self._inner.batch_size

    @property
    def lengths(self):
        return self._inner.lengths

    def reset(self, batch_size):
        self._inner.reset(batch_size)

    def forward(self, ids, positions, new_mask, logit_rows=None):
        self.calls += 1
        assert ids.shape[0] == self._inner.batch_size
        return self._inner.forward(ids, positions, new_mask, logit_rows)

    def commit(self, row, kept):
        self._inner.commit(row, kept)

    def set_taps(self, taps):
        self._inner.set_taps(taps)


@pytest.mark.parametrize("kind", ["none", "dspark"])
def test_engines_without_row_views_fall_back_to_whole_batch_steps(target, alone, kind):
    engine = ProtocolOnlyEngine(TorchTargetEngine(target, 128, 3))
    batcher = Batcher(engine, KINDS[kind](target), "confidence", SPS)
    assert not batcher.views
    requests = [Request(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    drive(batcher, requests)
    assert [r.tokens for r in requests] == alone and engine.calls > 0


def test_row_views_share_the_cache():
    target = tiny_target(seed=4)
    engine = TorchTargetEngine(target, 32, 4)
    view = row_view(engine, 1, 3)
    assert view.batch_size == 2 and view.k_cache.data_ptr() == engine.k_cache[:, 1].data_ptr()
    from specrt.runtime.generate import prefill

    prefill(view, [[1, 2, 3], [4, 5]])
    assert engine.lengths.tolist() == [0, 3, 2, 0]
    full, _ = prefill(TorchTargetEngine(target, 32, 1), [[4, 5]])
    logits, _ = view.forward(torch.tensor([[0], [6]]), torch.tensor([[3], [2]]), torch.ones(2, 1, 1, dtype=torch.bool))
    ref, _ = TorchTargetEngine(target, 32, 1).forward(torch.tensor([[4, 5, 6]]), torch.arange(3)[None],
                                                     torch.tril(torch.ones(1, 3, 3, dtype=torch.bool)))
    torch.testing.assert_close(logits[1, 0], ref[0, 2], rtol=1e-4, atol=1e-4)
    assert full.shape[-1] == target.config.vocab_size
    reset_engine_row(engine, 1)
    assert engine.lengths.tolist() == [0, 0, 2, 0]
    assert runs([5, 1, 2, 7, 6]) == [(1, 3), (5, 8)]
    proposer = block(target, "dflash")
    proposer.reset(4, 32)
    pview = proposer_prefix_view(proposer, 2)
    assert pview.batch_size == 2 and pview.lengths is proposer.lengths
    assert pview.k_cache.data_ptr() == proposer.k_cache.data_ptr()


# ---------------------------------------------------------------- sampling under batching

SMALL_VOCAB = 6
SAMPLES = 3000


@pytest.fixture(scope="module")
def small_target():
    model = tiny_target(vocab=SMALL_VOCAB, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    return model


def sample_batched(model, proposer, prompt, params, n, cost="packed", slots=500, seeded_sampling="stream"):
    """SAMPLES requests of the same prompt through `slots` rows, with the confidence schedule.
    Seeds make the run reproducible; "stream" keeps them on rejection sampling (verify.py)."""
    sps = lambda b: 1.0 / (1.0 + 0.0007 * b)
    batcher = Batcher(TorchTargetEngine(model, 32, slots), proposer, "confidence", sps, cost=cost, draft_gate=False,
                      seeded_sampling=seeded_sampling)
    lengths = set()
    requests = []
    for i in range(SAMPLES):
        s = SamplingParams(params.temperature, params.top_k, params.top_p, seed=i)
        requests.append(batcher.add(Request(list(prompt), n, s)))
    while batcher.step():
        if batcher.last_schedule is not None:
            lengths.update(batcher.last_schedule.lengths)
    return [r.tokens for r in requests], lengths


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_sampling_under_batching_keeps_the_target_distribution(small_target, kind):
    """Sampled drafts, verify lengths chosen per request by Algorithm 1 across 500 concurrent rows.
    (EAGLE-3's trees are deterministic, so any selection of their nodes is lossless; its tree
    verification is held to the distribution in test_speculative.py.)"""
    params = SamplingParams(temperature=0.9, top_k=5)
    prompt = [1, 4, 2]
    samples, lengths = sample_batched(small_target, block(small_target, kind), prompt, params, 3)
    assert len(lengths) > 1, "the scheduler should give requests different verify lengths"
    exact = exact_first_tokens(small_target, prompt, params, 3)
    assert chi_square_pvalue(samples, exact, 3) > 1e-3


def test_the_sampling_test_catches_a_wrong_acceptance_rule(small_target, monkeypatch):
    """Negative control: the same batched run, with drafts accepted without the ratio test, fails."""
    import specrt.runtime.step as loop

    def accept_everything(tokens, draft_probs, target_probs, generator=None):
        k = int(tokens.shape[0])
        return k, int(torch.multinomial(target_probs[k].float(), 1, generator=generator))

    monkeypatch.setattr(loop, "verify_chain_sampling", accept_everything)
    params = SamplingParams(temperature=0.9, top_k=5)
    samples, _ = sample_batched(small_target, block(small_target, "dflash"), [1, 4, 2], params, 3)
    assert chi_square_pvalue(samples, exact_first_tokens(small_target, [1, 4, 2], params, 3), 3) < 1e-6


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_seeded_noise_sampling_keeps_the_target_distribution(small_target, kind):
    """Seeded requests ("noise": Gumbel-max on (seed, index)-keyed noise, greedy drafts, verified on
    the perturbed scores) are exact samples of the target too, under batching and Algorithm 1."""
    params = SamplingParams(temperature=0.9, top_k=5)
    prompt = [1, 4, 2]
    samples, _ = sample_batched(small_target, block(small_target, kind), prompt, params, 3, seeded_sampling="noise")
    assert chi_square_pvalue(samples, exact_first_tokens(small_target, prompt, params, 3), 3) > 1e-3


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_seed_gives_the_same_text_alone_batched_and_drafted(target, kind):
    """A seeded request's tokens depend on its prompt, sampling settings and seed only: the same as
    plain decoding alone, batched with greedy and other seeded requests, with any drafter, the
    confidence schedule and the (timing-driven) draft gate on."""
    settings = [SamplingParams(0.8, seed=3), SamplingParams(), SamplingParams(1.0, top_p=0.9, seed=11),
                SamplingParams(0.6, top_k=8, seed=3), SamplingParams(0.8, seed=4), SamplingParams(1.2, seed=0)]

    def run(proposer, indices, slots):
        batcher = Batcher(TorchTargetEngine(target, 128, slots), proposer, "confidence", SPS)
        reqs = [Request(PROMPTS[i], MAX_NEW[i], settings[i]) for i in indices]
        drive(batcher, reqs, arrivals={0: list(range(len(reqs)))})
        return [r.tokens for r in reqs]

    alone = [run(None, [i], 1)[0] for i in range(len(PROMPTS))]
    assert run(KINDS[kind](target), list(range(len(PROMPTS))), 3) == alone
    if kind == "none":  # the seed matters: another seed, another text
        other = Request(PROMPTS[0], MAX_NEW[0], SamplingParams(0.8, seed=5))
        drive(Batcher(TorchTargetEngine(target, 128, 1)), [other], arrivals={0: [0]})
        assert other.tokens != alone[0]
