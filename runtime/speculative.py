"""The speculative loop, written once over `TargetEngine` and `Proposer` (DESIGN.md section 3).

Per round, for all active rows together:
  draft   proposer.propose -> a chain or tree of drafts per row
  verify  one target forward over [anchor, drafts...] per row (padded to the longest row),
          causal for chains, ancestor-or-self for trees, positions = anchor position + depth
  accept  specrt.runtime.verify (greedy or sampling, chain or tree) -> accepted path + bonus
  commit  the target keeps the anchor and the accepted path (`kv_keep_indices`); the proposer
          ingests the same tokens with the target's taps; the bonus becomes the next anchor.
Greedy output is token-for-token the target's own greedy output; sampled output has exactly the
target's distribution (the sampling transform of `specrt.runtime.sampling` is applied to p_t).

Stats: `rounds` counts verify steps; tau = tokens emitted by verify steps / rounds (1.00 for plain
decoding; the first token comes from prefill and is not part of tau).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from specrt.plugins.errors import SpecrtError
from specrt.runtime.engine import TargetEngine
from specrt.runtime.generate import GenerationResult, TokenCallback, prefill, validate_request
from specrt.runtime.proposers.base import Proposal, Proposer
from specrt.runtime.sampling import SamplingParams, next_token, probabilities
from specrt.runtime.stats import RequestStats
from specrt.runtime.tree import kv_keep_indices, tree_attention_mask, tree_positions
from specrt.runtime.verify import verify_chain_greedy, verify_chain_sampling, verify_tree_greedy, verify_tree_sampling


def _verify_batch(proposals: list[Proposal | None], anchors: list[int], lengths: torch.Tensor):
    """ids, positions, new_mask [B, T, T] for [anchor, drafts...] of each row (None rows: a dummy)."""
    batch = len(proposals)
    sizes = [1 + (len(p) if p is not None else 0) for p in proposals]
    t = max(sizes)
    ids = torch.zeros(batch, t, dtype=torch.long)
    positions = torch.zeros(batch, t, dtype=torch.long)
    mask = torch.eye(t, dtype=torch.bool).repeat(batch, 1, 1)  # padding sees only itself
    for b, p in enumerate(proposals):
        base = int(lengths[b])
        ids[b, 0] = anchors[b]
        positions[b, :] = base
        if p is None or len(p) == 0:
            continue
        n = len(p)
        ids[b, 1:n + 1] = p.tokens
        positions[b, : n + 1] = tree_positions(p.parents, base, with_root=True)
        mask[b, : n + 1, : n + 1] = tree_attention_mask(p.parents, with_root=True)
    return ids, positions, mask


def _accept(p: Proposal, logits: torch.Tensor, sampling: SamplingParams, generator) -> tuple[list[int], int]:
    """Accepted path (node indices) and the token emitted after it, for one row."""
    n = len(p)
    rows = logits[: n + 1]
    if sampling.greedy:
        if p.is_chain:
            k, bonus = verify_chain_greedy(p.tokens, rows)
            return list(range(k)), bonus
        return verify_tree_greedy(p.tokens, p.parents, rows)
    target_probs = probabilities(rows, sampling)
    if p.is_chain:
        k, bonus = verify_chain_sampling(p.tokens, p.draft_probs, target_probs, generator)
        return list(range(k)), bonus
    return verify_tree_sampling(p.tokens, p.parents, target_probs, p.draft_probs, generator)


def generate_speculative(
    engine: TargetEngine,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    on_tokens: TokenCallback | None = None,
) -> GenerationResult:
    validate_request(prompts, max_new_tokens, engine.capacity, engine.config.vocab_size)
    if getattr(engine, "spare_slots", proposer.max_drafts + 1) < proposer.max_drafts + 1:
        raise SpecrtError(
            f"the target engine has {engine.spare_slots} spare cache slots, the {proposer.name} drafter "
            f"verifies up to {proposer.max_drafts + 1} tokens per step",
            "build the engine with spare_slots >= the drafter's verify size",
        )
    batch = len(prompts)
    engine.set_taps(proposer.tap_layers)
    engine.reset(batch)
    proposer.reset(batch, engine.capacity)
    generator = None if sampling.greedy else sampling.generator()
    stats = [RequestStats(prompt_tokens=len(p)) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * batch
    eos = set(eos_token_ids)
    wall = time.perf_counter()

    def emit(b: int, tokens: list[int]) -> None:
        """Append tokens to row b, stopping at eos / max_new_tokens / a full cache."""
        taken = []
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
        if not done[b] and int(engine.lengths[b]) + 1 >= engine.capacity:
            done[b], stats[b].finish_reason = True, "cache_full"
        if on_tokens and taken:
            on_tokens(b, taken)

    logits, taps = prefill(engine, prompts)
    first = next_token(logits, sampling, generator).tolist()
    t0 = time.perf_counter()
    proposer.observe(list(range(batch)), [list(p) for p in prompts],
                     [None if taps is None else taps[b, : len(p)] for b, p in enumerate(prompts)], first)
    prefill_seconds = time.perf_counter() - wall
    anchors = list(first)
    for b in range(batch):
        stats[b].prefill_seconds = prefill_seconds
        stats[b].draft_seconds += time.perf_counter() - t0
        emit(b, [first[b]])

    step_timer = getattr(proposer, "observe_step_time", None)
    while not all(done):
        active = [b for b in range(batch) if not done[b]]
        t_draft = time.perf_counter()
        drafted = proposer.propose(active, [anchors[b] for b in active], sampling, generator)
        proposals: list[Proposal | None] = [None] * batch
        for b, p in zip(active, drafted):
            # never verify past the cache: the anchor and every draft need a committed-able slot
            room = engine.capacity - 1 - int(engine.lengths[b])
            proposals[b] = p.truncated(max(room, 0))
        t_verify = time.perf_counter()
        ids, positions, new_mask = _verify_batch(proposals, anchors, engine.lengths)
        logits, taps = engine.forward(ids, positions, new_mask)
        t_host = time.perf_counter()
        if step_timer is not None:  # a proposer that sizes its drafts by measured step cost
            step_timer(int(ids.shape[0]), int(ids.shape[1]), t_host - t_verify)
        obs_rows, obs_tokens, obs_taps, obs_next = [], [], [], []
        for b in active:
            p = proposals[b]
            path, bonus = _accept(p, logits[b], sampling, generator)
            keep = kv_keep_indices(path)
            engine.commit(b, keep)
            accepted = [int(p.tokens[i]) for i in path]
            stats[b].rounds += 1
            stats[b].record_acceptance(p.depth, len(path))
            emit(b, accepted + [bonus])
            anchors[b] = bonus
            if not done[b]:
                obs_rows.append(b)
                obs_tokens.append([int(ids[b, 0])] + accepted)
                obs_taps.append(None if taps is None else taps[b, keep])
                obs_next.append(bonus)
        t_observe = time.perf_counter()
        if obs_rows:
            proposer.observe(obs_rows, obs_tokens, obs_taps, obs_next)
        t_end = time.perf_counter()
        for b in active:
            stats[b].draft_seconds += (t_verify - t_draft) + (t_end - t_observe)
            stats[b].verify_seconds += t_host - t_verify
            stats[b].host_seconds += t_observe - t_host
    for s in stats:
        # tau counts tokens of verify steps only: the prefill token is not part of it
        s.round_tokens = s.new_tokens - 1
    return GenerationResult(outputs, stats, time.perf_counter() - wall)
