"""Plain autoregressive generation over any `TargetEngine` (the baseline speculation must beat).

Batch > 1 is supported with per-request prompt lengths: the prompts are prefilled together
(right-padded), then every step feeds each unfinished row its last token. Finished rows ride along
uncommitted until the whole batch is done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specrt.plugins.errors import SpecrtError
from specrt.runtime.engine import TargetEngine, causal_mask
from specrt.runtime.sampling import SamplingParams, next_token
from specrt.runtime.stats import RequestStats

TokenCallback = Callable[[int, list[int]], None]  # (row, new token ids) as they are produced


@dataclass
class GenerationResult:
    tokens: list[list[int]]
    stats: list[RequestStats]
    wall_seconds: float


def validate_request(prompts: Sequence[Sequence[int]], max_new_tokens: int, capacity: int, vocab_size: int) -> None:
    """Refuse what cannot be generated: no tokens asked, empty prompts, prompts the cache cannot hold."""
    if max_new_tokens < 1:
        raise SpecrtError(f"max_new_tokens must be >= 1, got {max_new_tokens}", "ask for at least one token")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise SpecrtError("empty prompt", "give at least one token of prompt text")
    longest = max(len(p) for p in prompts)
    if longest >= capacity:
        raise SpecrtError(
            f"the prompt has {longest} tokens but the KV cache holds {capacity} (one slot must stay free to generate)",
            "shorten the prompt or raise --capacity (up to the model's max_position_embeddings)",
        )
    bad = [t for p in prompts for t in p if not 0 <= t < vocab_size]
    if bad:
        raise SpecrtError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", "encode the prompt with the model's own tokenizer")


def prefill(engine: TargetEngine, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the prompts through the target, commit them; return last-position logits [B, V] and all taps."""
    batch = len(prompts)
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(batch, longest, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    positions = torch.arange(longest).expand(batch, longest)
    last = torch.tensor([[len(p) - 1] for p in prompts])
    logits, taps = engine.forward(ids, positions, causal_mask(batch, longest, [len(p) for p in prompts]), last)
    for b, p in enumerate(prompts):
        engine.commit(b, range(len(p)))
    return logits[:, 0], taps


def generate_autoregressive(
    engine: TargetEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    on_tokens: TokenCallback | None = None,
) -> GenerationResult:
    validate_request(prompts, max_new_tokens, engine.capacity, engine.config.vocab_size)
    batch = len(prompts)
    engine.reset(batch)
    generator = None if sampling.greedy else sampling.generator()
    stats = [RequestStats(prompt_tokens=len(p)) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * batch
    eos = set(eos_token_ids)
    wall = time.perf_counter()

    logits, _ = prefill(engine, prompts)
    prefill_seconds = time.perf_counter() - wall
    for s in stats:
        s.prefill_seconds = prefill_seconds

    while True:
        t0 = time.perf_counter()
        tokens = next_token(logits, sampling, generator).tolist()
        for b in range(batch):
            if done[b]:
                continue
            outputs[b].append(tokens[b])
            stats[b].new_tokens += 1
            if on_tokens:
                on_tokens(b, [tokens[b]])
            if tokens[b] in eos:
                done[b], stats[b].finish_reason = True, "eos"
            elif len(outputs[b]) >= max_new_tokens:
                done[b], stats[b].finish_reason = True, "length"
            elif int(engine.lengths[b]) + 1 >= engine.capacity:
                done[b], stats[b].finish_reason = True, "cache_full"
        host = time.perf_counter() - t0
        if all(done):
            for b in range(batch):
                stats[b].host_seconds += host
            break
        t1 = time.perf_counter()
        ids = torch.tensor(tokens, dtype=torch.long)[:, None]
        positions = engine.lengths.clone()[:, None]
        logits, _ = engine.forward(ids, positions, torch.ones(batch, 1, 1, dtype=torch.bool))
        logits = logits[:, 0]
        for b in range(batch):
            if not done[b]:
                engine.commit(b, [0])
        step = time.perf_counter() - t1
        for b in range(batch):
            if not done[b]:
                stats[b].rounds += 1
                stats[b].verify_seconds += step
                stats[b].host_seconds += host
    for s in stats:
        s.round_tokens = s.new_tokens - 1  # the first token comes from prefill, not a decode step
    return GenerationResult(outputs, stats, time.perf_counter() - wall)
