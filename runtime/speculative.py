"""Speculative decoding of a batch of prompts: `generate` with a proposer (DESIGN.md section 5).

Per step, for all unfinished rows together (`specrt.runtime.step.DecodeStep`):
  draft   proposer.propose -> a chain or tree of drafts per row
  verify  one target forward over [anchor, drafts...] per row (padded to the longest row),
          causal for chains, ancestor-or-self for trees, positions = anchor position + depth
  accept  per row: greedy, seeded (Gumbel-max keyed by seed and token index) or rejection
          sampling (specrt.runtime.verify) -> accepted path + bonus
  commit  the target keeps the anchor and the accepted path (`kv_keep_indices`); the proposer
          ingests the same tokens with the target's taps; the bonus becomes the next anchor.
Greedy output is token-for-token the target's own greedy output; sampled output has exactly the
target's distribution (the sampling transform of `specrt.runtime.sampling` is applied to p_t); a
seeded request gives the same text as plain decoding and as the server with that seed.

Stats: `rounds` counts verify steps; tau = tokens emitted by verify steps / rounds (1.00 for plain
decoding; the first token comes from prefill and is not part of tau).
"""

from __future__ import annotations

from collections.abc import Sequence

from specrt.runtime.engine import TargetEngine
from specrt.runtime.generate import GenerationResult, TokenCallback, generate
from specrt.runtime.proposers.base import Proposer
from specrt.runtime.sampling import SamplingParams


def generate_speculative(
    engine: TargetEngine,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    on_tokens: TokenCallback | None = None,
    seeded_sampling: str = "noise",
) -> GenerationResult:
    """Speculative generation with `proposer` (seeded_sampling: `specrt.runtime.generate`)."""
    return generate(engine, proposer, prompts, max_new_tokens, sampling, eos_token_ids, on_tokens, seeded_sampling)
