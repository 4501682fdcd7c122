"""Seeded rows draft on the noise their verification adds (`specrt.runtime.seeded.DraftNoise`).

Where that noise decides every token, a drafter coupled to it is always right: every draft of every
round is accepted. The same drafters drafting greedily (not coupled) are not, so the check can fail.
"""

from __future__ import annotations

import pytest
import torch

import specrt.runtime.seeded as seeded
from specrt.runtime.backends.torch_backend import TorchTargetEngine
from specrt.runtime.generate import generate_autoregressive
from specrt.runtime.proposers.block import BlockProposer
from specrt.runtime.proposers.eagle3 import Eagle3Proposer
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.seeded import DraftNoise, seeded_token
from specrt.runtime.speculative import generate_speculative
from tests.test_speculative import block, eagle3, tiny_target

PROMPT = [1, 5, 9, 2]
NEW = 24
PARAMS = SamplingParams(temperature=1.0, seed=7)


def test_the_seeded_rule_is_gumbel_noise_of_the_index_stream_over_scaled_logits():
    """What text a seed gives: G = -log(-log u) of torch's uniform stream keyed by (seed, index), added to
    logits / T (at T = 1 the logits as they are). Pinned here so a faster computation keeps the values."""
    torch.manual_seed(0)
    for seed, index, vocab in ((0, 0, 50), (7, 13, 300), (123456, 999, 49152)):
        u = torch.rand(vocab, generator=torch.Generator().manual_seed(seeded._stream_key(seed, index)))
        assert torch.equal(seeded.gumbel_noise(seed, index, vocab), -torch.log(-torch.log(u)))
        logits = torch.randn(1, vocab) * 4
        for temperature in (1.0, 0.7):
            params = SamplingParams(temperature=temperature, seed=seed)
            want = logits / temperature - torch.log(-torch.log(u))
            assert torch.equal(seeded.perturbed_scores(logits, params, [index]), want)


def test_draft_noise_scores_pick_the_token_plain_decoding_picks():
    """Depth d of a row whose first draft is generated index i is checked at index i + d - 1; a
    reduced vocabulary sees the same scores at its ids."""
    torch.manual_seed(0)
    vocab = 300
    params = SamplingParams(temperature=0.7, top_k=40, seed=3)
    noise = DraftNoise(params, first_index=5)
    for depth in (1, 2, 4):
        logits = torch.randn(vocab) * 3
        assert int(noise.scores(logits, depth).argmax()) == seeded_token(logits, params, 5 + depth - 1)
    ids = torch.tensor([3, 17, 40, 299])
    logits = torch.randn(vocab)
    sub = noise.scores(logits[ids], 2, vocab_size=vocab, token_ids=ids)
    plain_params = SamplingParams(temperature=0.7, seed=3)  # top-k over the subset differs: compare without it
    full = DraftNoise(plain_params, 5).scores(logits, 2)
    assert torch.equal(DraftNoise(plain_params, 5).scores(logits[ids], 2, vocab_size=vocab, token_ids=ids), full[ids])
    assert sub.shape == (4,)
    # several depths at once: one row per depth
    rows = torch.randn(3, vocab)
    assert torch.equal(noise.scores(rows, range(1, 4)), torch.stack([noise.scores(rows[i], i + 1) for i in range(3)]))


@pytest.fixture
def deciding_noise(monkeypatch):
    """Noise that makes token (7 * index + 3) mod V the seeded token at every index."""

    def noise(seed: int, index: int, vocab_size: int) -> torch.Tensor:
        g = torch.zeros(vocab_size)
        g[(7 * index + 3) % vocab_size] = 1e4
        return g

    monkeypatch.setattr(seeded, "gumbel_noise", noise)
    return lambda index, vocab: (7 * index + 3) % vocab


def proposer_for(target, kind: str):
    if kind == "eagle3-chain":
        return eagle3(target, top_k=1)
    if kind == "eagle3-tree":
        return eagle3(target, top_k=3)
    name, _, shape = kind.partition("-")
    return block(target, name, tree_top_k=2 if shape == "tree" else 1, tree_tokens=6)


KINDS = ["eagle3-chain", "eagle3-tree", "dflash-chain", "dflash-tree", "dspark-chain", "dspark-tree"]


@pytest.mark.parametrize("kind", KINDS)
def test_coupled_drafts_are_all_accepted_where_the_noise_decides(deciding_noise, kind, monkeypatch):
    target = tiny_target()
    vocab = target.config.vocab_size
    expected = [deciding_noise(i, vocab) for i in range(NEW)]
    plain = generate_autoregressive(TorchTargetEngine(target, 64, 1), [PROMPT], NEW, PARAMS)
    assert plain.tokens[0] == expected  # the noise decides the text

    def run(couples: bool):
        proposer = proposer_for(target, kind)
        monkeypatch.setattr(type(proposer), "couples_noise", couples)
        out = generate_speculative(TorchTargetEngine(target, 64, 1), proposer, [PROMPT], NEW, PARAMS)
        assert out.tokens[0] == expected  # lossless either way
        stats = out.stats[0]
        return (len(out.tokens[0]) - stats.rounds) / stats.rounds

    # drafts per round: EAGLE-3 depth 4; block size 5: DFlash 4 drafts, DSpark 5
    full = 5 if kind.startswith("dspark") else 4
    assert run(True) >= full - 0.25  # every draft accepted: only the last round is cut short
    assert run(False) < 1.0


def test_proposers_that_do_not_couple_noise_are_never_handed_any(deciding_noise):
    """A proposer without `couples_noise` keeps the plain propose signature (the decode step's contract)."""
    target = tiny_target()

    class Plainly:
        name, tap_layers, max_drafts = "plainly", (), 2

        def reset(self, batch_size, capacity):
            self.lengths = [0] * batch_size

        def context_length(self, row):
            return self.lengths[row]

        def observe(self, rows, tokens, taps, next_tokens):
            for b, t in zip(rows, tokens):
                self.lengths[b] += len(t)

        def propose(self, rows, anchors, sampling, generator):  # no noise keyword: a TypeError if given one
            assert sampling.greedy  # seeded rows draft greedily
            return [_chain([5, 6])] * len(rows)

    out = generate_speculative(TorchTargetEngine(target, 64, 1), Plainly(), [PROMPT], 8, PARAMS)
    assert out.tokens[0] == [deciding_noise(i, target.config.vocab_size) for i in range(8)]
    assert Eagle3Proposer.couples_noise and BlockProposer.couples_noise


def _chain(tokens):
    from specrt.runtime.proposers.base import Proposal

    return Proposal.chain(torch.tensor(tokens, dtype=torch.long))
