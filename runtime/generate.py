"""Generation for a batch of prompts, plain or speculative: prefill, then decoding steps until done.

`generate(engine, proposer, prompts, ...)` prefills the prompts together (right-padded), picks each
row's first token, then runs `specrt.runtime.step.DecodeStep` until every row has stopped (eos,
max_new_tokens, a full cache); finished rows ride along uncommitted. Without a proposer every step
verifies the empty proposal: plain autoregressive decoding, the baseline speculation must beat
(`generate_autoregressive`); with one it is speculative decoding (`specrt.runtime.speculative`).

Sampling: one `SamplingParams` for the batch. With a seed (and temperature > 0) each row follows the
seeded rule of `specrt.runtime.seeded` with `row_seed(seed, row)`, so a request's text is the same
here, in serving, with or without a drafter; seeded_sampling="stream" instead draws rejection
sampling's coins from one generator started from the seed (reproducible only for the same batch and
drafter). Without a seed rows share one freshly seeded generator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from specrt.plugins.errors import SpecrtError
from specrt.runtime.engine import TargetEngine, causal_mask
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.seeded import row_seed
from specrt.runtime.stats import RequestStats
from specrt.runtime.step import SEEDED_SAMPLING, DecodeStep, StepRow, TokenRule

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


def batch_rules(sampling: SamplingParams, batch: int, seeded_sampling: str = "noise") -> list[TokenRule]:
    """Each row's `TokenRule` (module docstring): seeded rows with their own seeds, else one shared generator."""
    if seeded_sampling not in SEEDED_SAMPLING:
        raise SpecrtError(f"unknown seeded_sampling {seeded_sampling!r}", f"use one of {', '.join(SEEDED_SAMPLING)}")
    if sampling.greedy:
        return [TokenRule(sampling)] * batch
    if sampling.seed is not None and seeded_sampling == "noise":
        return [TokenRule.of(replace(sampling, seed=row_seed(sampling.seed, b))) for b in range(batch)]
    generator = sampling.generator()
    return [TokenRule(sampling, generator)] * batch


def generate(
    engine: TargetEngine,
    proposer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    on_tokens: TokenCallback | None = None,
    seeded_sampling: str = "noise",
) -> GenerationResult:
    """Generate up to max_new_tokens per prompt; proposer None decodes plainly (module docstring)."""
    validate_request(prompts, max_new_tokens, engine.capacity, engine.config.vocab_size)
    if proposer is not None and getattr(engine, "spare_slots", proposer.max_drafts + 1) < proposer.max_drafts + 1:
        raise SpecrtError(
            f"the target engine has {engine.spare_slots} spare cache slots, the {proposer.name} drafter "
            f"verifies up to {proposer.max_drafts + 1} tokens per step",
            "build the engine with spare_slots >= the drafter's verify size",
        )
    rules = batch_rules(sampling, len(prompts), seeded_sampling)
    batch = len(prompts)
    engine.set_taps(() if proposer is None else proposer.tap_layers)
    engine.reset(batch)
    if proposer is not None:
        proposer.reset(batch, engine.capacity)
        begin = getattr(proposer, "begin_request", None)
        if begin is not None:  # what the proposer learned on earlier requests sampled alike
            begin(sampling, seeded_sampling)
    stats = [RequestStats(prompt_tokens=len(p)) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * batch
    eos = set(eos_token_ids)
    wall = time.perf_counter()

    def emit(row: StepRow, tokens: list[int]) -> bool:
        """Append tokens to the row, stopping at eos / max_new_tokens / a full cache; True while it goes on."""
        b, taken = row.row, []
        for tok in tokens:
            taken.append(tok)
            if tok in eos:
                done[b], stats[b].finish_reason = True, "eos"
                break
            if len(outputs[b]) + len(taken) >= max_new_tokens:
                done[b], stats[b].finish_reason = True, "length"
                break
        outputs[b].extend(taken)
        stats[b].new_tokens += len(taken)
        # the cache holds the prompt and every emitted token but the last, the anchor (read here in
        # Python, not from engine.lengths: a torch op per token costs plain decoding ~1%)
        if not done[b] and len(prompts[b]) + len(outputs[b]) >= engine.capacity:
            done[b], stats[b].finish_reason = True, "cache_full"
        if on_tokens and taken:
            on_tokens(b, taken)
        return not done[b]

    logits, taps = prefill(engine, prompts)
    rows = [StepRow(b, rules[b].first(logits[b]), rules[b], 1, stats[b]) for b in range(batch)]
    t0 = time.perf_counter()
    if proposer is not None:
        proposer.observe(list(range(batch)), [list(p) for p in prompts],
                         [None if taps is None else taps[b, : len(p)] for b, p in enumerate(prompts)],
                         [r.anchor for r in rows])
    prefill_seconds = time.perf_counter() - wall
    for r in rows:
        r.stats.prefill_seconds = prefill_seconds
        r.stats.draft_seconds += time.perf_counter() - t0
        emit(r, [r.anchor])

    # rejection-sampled drafts draw from the rows' shared generator (seeded rows draft greedily)
    step = DecodeStep(proposer, draft_generator=rules[0].generator)
    while not all(done):
        step(engine, [r for r in rows if not done[r.row]], emit)
    for s in stats:
        # tau counts tokens of decoding steps only: the prefill token is not part of it
        s.round_tokens = s.new_tokens - 1
    return GenerationResult(outputs, stats, time.perf_counter() - wall)


def generate_autoregressive(
    engine: TargetEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    on_tokens: TokenCallback | None = None,
    seeded_sampling: str = "noise",
) -> GenerationResult:
    """Plain decoding: `generate` without a proposer."""
    return generate(engine, None, prompts, max_new_tokens, sampling, eos_token_ids, on_tokens, seeded_sampling)
