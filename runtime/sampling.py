"""Sampling parameters and the target-side distribution transform.

`probabilities(logits, params)` is THE definition of the distribution we sample from: temperature,
then top-k, then top-p (nucleus), renormalised. Speculative verification applies exactly this
transform to the target's logits (p_t), so speculation is lossless with respect to it. Greedy
(temperature 0) is argmax and needs no distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specrt.plugins.errors import SpecrtError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise SpecrtError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}",
                "use 0 for greedy decoding or a positive value such as 0.7 for sampling",
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecrtError(f"top_k must be an integer >= 0, got {self.top_k!r}", "use 0 to disable top-k")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise SpecrtError(f"top_p must be in (0, 1], got {self.top_p!r}", "use 1.0 to disable nucleus sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def distribution(self) -> object:
        """What a request samples from, its seed aside ("greedy", or temperature, top-k and top-p):
        requests alike draft alike and share what the proposers learn about their drafts."""
        return "greedy" if self.greedy else (self.temperature, self.top_k, self.top_p)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(self.seed))
        return gen


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p (float32)."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of probs [..., V] -> [...] int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick the next token from logits [..., V]: argmax when greedy, else a sample of `probabilities`."""
    if params.greedy:
        return logits.argmax(-1)
    assert generator is not None
    return sample(probabilities(logits, params), generator)
