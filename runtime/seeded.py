"""Seeded sampling that speculation, batching and scheduling cannot change.

Why: with rejection sampling (`specrt.runtime.verify`) a request's random stream is consumed at a
rate that depends on what was drafted, how many drafts the scheduler verified and whether the
serving draft gate was open (which depends on measured step times). The output keeps the target's
distribution, but the same prompt and seed give different text from one call to the next. Users of
`seed` expect the same text.

How: the n-th generated token of a request (n = 0 for the token after the prompt) is

    x_n = argmax_v ( log p_n(v) + G_n(v) ),   p_n = probabilities(logits, params)

with G_n a vector of i.i.d. Gumbel(0, 1) noise drawn from a generator keyed by (seed, n) alone.
This is the Gumbel-max trick: x_n is an exact sample of p_n, and G_n is independent of G_<n (which
decided the prefix), so the sequence is an exact sample of the target, token by token. Top-k / top-p
zeros become -inf scores and are never chosen.

Verification is greedy verification on the perturbed scores: a draft is accepted iff it equals
the token plain decoding with that seed would pick at its index, and the bonus is that token. So
the output is a function of (prompt, sampling params, seed) only: the same with or without a
drafter, alone or batched, whatever verify length the scheduler picks.

Coupled drafts: the noise of every index is known before the target sees it, so a drafter can
draft on the same noise, y_n = argmax_v (log q_n(v) + G_n(v)) (`DraftNoise`). Where q tracks p the
two perturbed argmaxes agree far more often than a sample of p equals argmax q (q = p: always), and
the drafts stay deterministic given the noise: verification treats them as point masses, measured
costs may size the round as they size greedy ones, and the output is unchanged. Measured on the
int4 DSpark folder (6 prompts, 128 tokens, temperature 1): 0.24 accepted drafts per round coupled
against 0.14 with greedy drafts. Proposers that draft this way say so (`couples_noise`); the others
draft greedily for these requests (argmax q is then the draft most likely to equal a sample of p
when q tracks p: p(argmax q) >= sum_v p(v) q(v)).

Where: every request with a seed and temperature > 0, in `generate` and in serving alike (the rule
is `specrt.runtime.step.TokenRule`), so `specrt generate --seed 1` and a served request with seed 1
give the same text. Row b of a batch generated with one seed uses `row_seed(seed, b)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from specrt.runtime.proposers.base import Proposal
from specrt.runtime.sampling import SamplingParams, probabilities
from specrt.runtime.tree import node_depths
from specrt.runtime.verify import verify_chain_greedy, verify_tree_greedy

_MASK64 = (1 << 64) - 1
NOISE_CACHE = 32  # noise vectors kept (about 200 KB each at a 49k vocabulary)


def _stream_key(seed: int, index: int) -> int:
    """A 63-bit generator seed for (seed, index): splitmix64 of both, so nearby seeds and indices
    give unrelated streams (manual_seed(seed + index) would make request 1's token 0 equal to
    request 0's token 1)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(index) + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def row_seed(seed: int, row: int) -> int:
    """The seed of row `row` of a batch generated with one seed: the seed itself for row 0 (a batch of
    one gives what a request with that seed gives alone), an unrelated 63-bit seed for the others
    (a batch of one prompt repeated still samples different texts). Negative indices: no token's."""
    return int(seed) if row == 0 else _stream_key(seed, -int(row))


@lru_cache(maxsize=NOISE_CACHE)
def gumbel_noise(seed: int, index: int, vocab_size: int) -> torch.Tensor:
    """[V] float32 Gumbel(0, 1) noise of generated-token index `index` of a request with `seed`.

    Cached (read-only: callers add to it, never write into it): a verify step draws the noise of
    every index it checks, and the indices past the first rejection are checked again next step."""
    u = torch.rand(vocab_size, generator=torch.Generator().manual_seed(_stream_key(seed, index)))
    # -log(-log u) in place: the same kernels, so the same values, without three fresh [V] tensors
    # (u == 0 gives -inf: that token is never the argmax)
    return u.log_().neg_().log_().neg_()


def scaled_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits / T, float32, -inf where top-k / top-p keep no mass: what the noise is added to."""
    # x / 1.0 is x exactly: at temperature 1 the division is a copy of the vocabulary for nothing
    scores = logits.float() if params.temperature == 1.0 else logits.float() / params.temperature
    if params.top_k or params.top_p < 1.0:
        scores = scores.masked_fill(probabilities(logits, params) == 0, float("-inf"))
    return scores


def perturbed_scores(logits: torch.Tensor, params: SamplingParams, indices: Sequence[int]) -> torch.Tensor:
    """logits [n, V] (row i predicts generated index indices[i]) -> logits / T + G, float32 [n, V],
    -inf where top-k / top-p keep no mass.

    On the tokens p keeps, log p = logits / T - logsumexp (a constant per row), so this has the
    argmax of log p + G without the softmax and the log (a third of a plain sampled step's host time)."""
    if params.seed is None or params.greedy:
        raise ValueError("perturbed scores are for seeded sampling (temperature > 0 and a seed)")
    scores = scaled_scores(logits, params)
    vocab = int(scores.shape[-1])
    if len(indices) == 1:
        return scores + gumbel_noise(params.seed, indices[0], vocab).to(scores.device)
    return scores + torch.stack([gumbel_noise(params.seed, i, vocab) for i in indices]).to(scores.device)


def seeded_token(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """The token at generated index `index` from logits [V]: what plain decoding with this seed picks."""
    return int(perturbed_scores(logits.unsqueeze(0), params, [index])[0].argmax())


def accept_seeded(p: Proposal, logits: torch.Tensor, params: SamplingParams, first_index: int) -> tuple[list[int], int]:
    """Accepted path (node indices) and bonus of one row, verifying on perturbed scores.

    logits [>= N+1, V]: row 0 predicts generated index `first_index`, row i+1 the token after node
    i, at index first_index + depth(node i)."""
    n = len(p)
    indices = [first_index] + [first_index + d for d in node_depths(p.parents)]
    scores = perturbed_scores(logits[: n + 1], params, indices)
    if p.is_chain:
        k, bonus = verify_chain_greedy(p.tokens, scores)
        return list(range(k)), bonus
    return verify_tree_greedy(p.tokens, p.parents, scores)


@dataclass(frozen=True)
class DraftNoise:
    """The noise a seeded row's verification adds at the indices its drafts take (module docstring).

    A draft at depth d (d = 1: the token after the anchor) is checked at generated index
    first_index + d - 1; siblings of a tree share their depth's noise."""

    params: SamplingParams  # the row's sampling: temperature, top-k / top-p and seed
    first_index: int  # generated index of a depth-1 draft (the step row's `generated`)

    def noise(self, depth: int, vocab_size: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[V] noise of depth `depth`, or [N] at `token_ids` (a drafter's reduced vocabulary, as target ids)."""
        g = gumbel_noise(int(self.params.seed), self.first_index + depth - 1, vocab_size)
        return g if token_ids is None else g[token_ids]

    def scores(self, logits: torch.Tensor, depth: int | Sequence[int], vocab_size: int | None = None,
               token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Drafter logits [..., N] at `depth` (or [n, N] at depths[i]) -> logits / T + G, float32:
        their argmax is the coupled draft. vocab_size: the target's (default: N, logits over the target's
        vocabulary); token_ids: the target id of each of the N logits."""
        vocab = int(vocab_size if vocab_size is not None else logits.shape[-1])
        scores = scaled_scores(logits, self.params)
        if isinstance(depth, int):
            g = self.noise(depth, vocab, token_ids)
        else:
            g = torch.stack([self.noise(int(d), vocab, token_ids) for d in depth])
        return scores + g.to(scores.device)


def is_seeded(params: SamplingParams) -> bool:
    return not params.greedy and params.seed is not None


GREEDY_DRAFTS = SamplingParams()
