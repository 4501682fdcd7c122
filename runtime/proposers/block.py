"""Block proposers: DFlash and DSpark draft a whole chain in one drafter forward pass.

Context: after each round the target's taps of the newly committed tokens are turned into the
drafter's context K/V (`ingest_context`) at their absolute positions; slot = position, so the
drafter's cache mirrors the target's. Drafting: the block [anchor, MASK x (Bk-1)] sits at positions
p .. p+Bk-1 (p = the anchor's position), sees every context slot < p and the whole block
(non-causal), and writes its own K/V into slots p.. which the next ingest overwrites.

DFlash: block index k predicts position p+k, so logits[:, 1:] are the Bk-1 drafts (DeepSpec's
DFlash-mode drafters: p+k+1, all Bk rows are drafts; `config.label_shift` says which); at T > 0 each
draft is sampled from q_k = `probabilities(logits_k, sampling)` (positions are independent given
the block, so x_k ~ q_k holds exactly as chain verification needs).
DSpark: gamma drafts through the Markov head (sequential in k), then confidence truncation: keep
the longest prefix whose calibrated survival prod sigmoid(z_i / T_i) stays >= `threshold`.

Seeded rows (`couples_noise`): drafts follow the noise their verification will add
(`specrt.runtime.seeded.DraftNoise`): DFlash takes argmax(logits / T + noise) per position, the
DSpark graph runs its Markov chain on the same scores (its `gumbel` input), trees rank children on
them. Survivals stay the drafter's own estimates (a tree's path scores are the perturbed ones).

All rows of the batch run together; rows that are not drafting this round get a dummy block at
position 0 (their requests are finished, so overwriting their slots costs nothing).

Trees (`tree_top_k > 1`): the same single drafter forward, then an EAGLE-2 dynamic tree
(`specrt.runtime.tree.build_dynamic_tree`) over the block's per-position distributions instead of
one argmax per position. Why: a small block drafter is often right about a position's token only
among its first few candidates (a 1-layer DFlash's top-1 is right .23 of the time on MT-bench),
and one verify pass can check several candidates per depth for the price of a few more rows.
- DFlash: position k's distribution does not depend on the tokens drafted before it, so every
  node at depth d gets the same candidate children (the top-k of position d+1): a Medusa-style
  tree, pruned to `tree_tokens - 1` nodes by path probability.
- DSpark: a child's distribution is the Markov head's step from its parent's token (and, for the
  GRU head, the state of the path so far): one batched head step per tree level, no backbone call.
Children are chosen deterministically (top-k), so verification treats them as point masses
(`draft_probs` None) at every temperature, which is lossless (`specrt.runtime.verify`). Survival
is the path probability, as for EAGLE-3 trees; the confidence threshold cuts chains only. The
exported DSpark graph runs its Markov chain inside the graph, so DSpark trees need the torch
drafter (DFlash trees run on both backends).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specrt.plugins.errors import SpecrtError
from specrt.export.models.dflash import DFlashDrafter
from specrt.export.models.dspark import DSparkDrafter
from specrt.runtime.proposers.base import Proposal
from specrt.runtime.sampling import SamplingParams, probabilities, sample
from specrt.runtime.tree import DraftTree, build_dynamic_tree


def pad_rows(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Stack [n_b, ...] tensors to [B, max n, ...] by repeating each row's last entry.

    Repeating (instead of zeros) makes padded entries rewrite the same slot with the same values,
    so padding can never clobber real context.
    """
    lengths = [int(t.shape[0]) for t in tensors]
    longest = max(lengths)
    out = []
    for t in tensors:
        if t.shape[0] < longest:
            t = torch.cat([t, t[-1:].expand(longest - t.shape[0], *t.shape[1:])], dim=0)
        out.append(t)
    return torch.stack(out), lengths


class BlockProposer:
    couples_noise = True  # seeded rows draft on their verification's noise (module docstring)

    def __init__(self, drafter: DFlashDrafter, threshold: float = 0.0, max_drafts: int | None = None,
                 tree_top_k: int = 1, tree_tokens: int = 16) -> None:
        self.drafter = drafter
        self.is_dspark = isinstance(drafter, DSparkDrafter) or getattr(drafter, "kind", None) == "dspark"
        self.name = "dspark" if self.is_dspark else "dflash"
        self.tap_layers = tuple(drafter.config.tap_layers)
        self.block_size = drafter.config.block_size
        # block index k predicts position p + k + label_shift: the config says whose convention (the
        # torch module and its ORT twin share it)
        self.label_shift = int(drafter.config.label_shift)
        num_drafts = self.block_size - 1 + self.label_shift
        # a verify step costs about its token count on a CPU: capping the chain trades tau for step cost
        self.max_drafts = min(num_drafts, max_drafts) if max_drafts else num_drafts
        self.threshold = float(threshold)
        self.device = drafter.device if hasattr(drafter, "device") else drafter.fc.weight.device
        # an engine's reduced block head (OrtBlockDrafter): DFlash logits cover its ids, mapped here
        self.draft_vocab = getattr(drafter, "draft_vocab", None)
        self.last_survival: torch.Tensor | None = None  # [B, gamma] of the last DSpark chain round
        self.tree_top_k, self.tree_tokens = int(tree_top_k), int(tree_tokens)
        if self.tree_top_k < 1 or self.tree_tokens < 2:
            raise SpecrtError(f"bad block tree settings top_k={tree_top_k} tokens={tree_tokens}",
                              "use --block-tree-top-k >= 1 (1 = a chain) and --tree-tokens >= 2")
        if self.tree_top_k > 1 and self.is_dspark and not hasattr(drafter, "markov_head"):
            raise SpecrtError("a DSpark draft tree needs the drafter's Markov head, and the exported DSpark "
                              "graph runs its Markov chain inside the graph",
                              "use --backend torch for DSpark trees, or --block-tree-top-k 1 (a chain)")

    def reset(self, batch_size: int, capacity: int) -> None:
        self.batch_size = batch_size
        self.k_cache, self.v_cache = self.drafter.new_cache(batch_size, capacity + self.block_size)
        self.lengths = [0] * batch_size

    def context_length(self, row: int) -> int:
        return self.lengths[row]

    @torch.inference_mode()
    def observe(self, rows, tokens, taps, next_tokens) -> None:
        positions = [torch.arange(self.lengths[b], self.lengths[b] + len(t)) for b, t in zip(rows, tokens)]
        if len(rows) == self.batch_size and list(rows) == list(range(self.batch_size)):
            tap_batch, _ = pad_rows(list(taps))
            pos_batch, _ = pad_rows(positions)
            self.drafter.ingest_context(tap_batch.to(self.device), pos_batch.to(self.device),
                                        self.k_cache, self.v_cache, pos_batch.to(self.device))
        else:  # a subset of rows: ingest row by row into their cache rows
            for b, tap, pos in zip(rows, taps, positions):
                self.drafter.ingest_context(tap[None].to(self.device), pos[None].to(self.device),
                                            self.k_cache[:, b:b + 1], self.v_cache[:, b:b + 1], pos[None].to(self.device))
        for b, t in zip(rows, tokens):
            self.lengths[b] += len(t)

    def _perturbed(self, logits: torch.Tensor, depth, noise) -> torch.Tensor:
        """logits over the drafter's vocabulary at `depth` (or [n, N] at depths), perturbed by a seeded
        row's noise (None: as they are)."""
        if noise is None:
            return logits
        ids = None if self.draft_vocab is None else self.draft_vocab.token_ids.to(logits.device)
        return noise.scores(logits, depth, self.vocab_size, ids)

    @torch.inference_mode()
    def propose(self, rows, anchors, sampling: SamplingParams, generator, noise=None) -> list[Proposal]:
        noise_of = dict(zip(rows, noise)) if noise is not None else {}
        batch, bk = self.batch_size, self.block_size
        anchor = torch.zeros(batch, dtype=torch.long)
        start = torch.zeros(batch, dtype=torch.long)
        for b, a in zip(rows, anchors):
            anchor[b], start[b] = a, self.lengths[b]
        positions = start[:, None] + torch.arange(bk)[None, :]
        window = int(start.max()) + bk
        slots = torch.arange(window)[None, None, :]
        mask = (slots < start[:, None, None]) | ((slots >= start[:, None, None]) & (slots < (start + bk)[:, None, None]))
        mask = mask.expand(batch, bk, window)
        block = self.drafter.block_ids(anchor).to(self.device)
        args = (block, positions.to(self.device), mask.to(self.device), self.k_cache, self.v_cache, positions.to(self.device))
        if self.tree_top_k > 1:
            return self._trees(rows, anchor, args, noise_of)
        if self.is_dspark:
            temperature = 0.0 if sampling.greedy else sampling.temperature
            if any(n is not None for n in noise_of.values()):
                tokens, conf = self._coupled_markov_chain(args, noise_of)
                probs = None
            else:
                tokens, probs, conf = self.drafter.draft(*args, temperature=temperature, generator=generator)
            survival = self.drafter.survival(conf)
            self.last_survival = survival
            keep = (survival >= self.threshold).long().cumprod(dim=-1).sum(dim=-1)
        else:
            logits, _ = self.drafter(*args)
            logits = logits[:, 1 - self.label_shift:]
            if sampling.greedy:
                tokens, probs = logits.argmax(-1), None
                for b, n in noise_of.items():
                    if n is not None:
                        tokens[b] = self._perturbed(logits[b], range(1, logits.shape[1] + 1), n).argmax(-1)
            else:
                probs = probabilities(logits, sampling)
                tokens = sample(probs, generator)
            # survival estimate: running product of each position's top draft probability; it never
            # looks at the drawn token, so a scheduler reading it keeps sampling lossless
            if probs is None:
                scores = logits.float()
                top = torch.exp(scores.amax(-1) - torch.logsumexp(scores, -1))
            else:
                top = probs.amax(-1)
            survival = top.cumprod(dim=-1)
            if self.draft_vocab is not None:  # draft ids -> target ids; q: zero mass outside the reduced set
                tokens = self.draft_vocab.to_target(tokens)
                probs = None if probs is None else self.draft_vocab.scatter(probs)
            # DFlash's survival is uncalibrated (top-prob product) but, like DSpark's, it never depends on
            # the drawn tokens, so truncating on it keeps verification lossless
            keep = (survival >= self.threshold).long().cumprod(dim=-1).sum(dim=-1)
        keep = keep.clamp(max=self.max_drafts)
        out = []
        for b in rows:
            n = int(keep[b])
            out.append(Proposal.chain(tokens[b, :n].cpu(), None if probs is None else probs[b, :n].cpu(),
                                      survival[b, :n].float().cpu()))
        return out

    @property
    def vocab_size(self) -> int:
        return int(self.drafter.config.vocab_size)  # the target's: the noise is drawn over it

    def _coupled_markov_chain(self, args, noise_of: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """DSpark's chain with each seeded row's Markov steps on its noise (the others greedy):
        tokens [B, gamma] and confidence logits. The graph takes x_k = argmax(l_k + T * g_k)."""
        gamma = int(args[0].shape[1])
        width = self.draft_vocab.size if self.draft_vocab is not None else self.vocab_size
        temperature = torch.zeros(self.batch_size, dtype=torch.float32)
        gumbel = torch.zeros(self.batch_size, gamma, width, dtype=torch.float32)
        ids = None if self.draft_vocab is None else self.draft_vocab.token_ids
        for b, n in noise_of.items():
            if n is not None:
                temperature[b] = n.params.temperature
                gumbel[b] = torch.stack([n.noise(k + 1, self.vocab_size, ids) for k in range(gamma)])
        tokens, _, conf = self.drafter.draft(*args, temperature=temperature.to(self.device),
                                             gumbel=gumbel.to(self.device))
        return tokens, conf

    # -- trees ------------------------------------------------------------------------------------
    def _trees(self, rows, anchor: torch.Tensor, args, noise_of: dict) -> list[Proposal]:
        """One drafter forward for the batch, then one dynamic tree per row (module docstring)."""
        logits, hidden = self.drafter(*args)
        out = []
        for b in rows:
            noise = noise_of.get(b)
            if self.is_dspark:
                tree = self._markov_tree(logits[b], hidden[b], int(anchor[b]), noise)
            else:
                # block index k predicts depth k + label_shift; one host copy of the depths the tree can reach
                first = 1 - self.label_shift
                per_depth = logits[b, first:first + self.max_drafts].float()
                per_depth = self._perturbed(per_depth, range(1, per_depth.shape[0] + 1), noise).cpu()

                def expand(frontier: list[int], pool: DraftTree, per_depth=per_depth) -> torch.Tensor:
                    depth = int(pool.depths[frontier[0]])  # a frontier is one level of the tree
                    return per_depth[depth].expand(len(frontier), -1)

                tree = build_dynamic_tree(per_depth[0], expand, self.tree_top_k, self.max_drafts, self.tree_tokens)
            tokens = tree.tokens if self.draft_vocab is None else self.draft_vocab.to_target(tree.tokens)
            out.append(Proposal(tokens, tree.parents, None, is_chain=False, depth=tree.max_depth,
                                survival=tree.cum_logprobs.exp().float()))
        return out

    def _markov_tree(self, base: torch.Tensor, hidden: torch.Tensor, anchor: int, noise=None) -> DraftTree:
        """DSpark: base [Bk, V] (index k predicts depth k+1) plus the Markov head's step per tree level."""
        head = self.drafter.markov_head
        dev = base.device
        state_after: dict[int, torch.Tensor | None] = {}  # pool id (-1: the anchor) -> head state after its token

        def step(depth: int, tokens: torch.Tensor, state: torch.Tensor | None):
            n = int(tokens.shape[0])
            return head.step(base[depth - 1].expand(n, -1), tokens.to(dev), hidden[depth - 1].expand(n, -1), state)

        root, root_state = step(1, torch.tensor([anchor]), None)
        state_after[-1] = None if root_state is None else root_state[0]

        def expand(frontier: list[int], pool: DraftTree) -> torch.Tensor:
            depth = int(pool.depths[frontier[0]])
            parents = [int(pool.parents[f]) for f in frontier]
            states = [state_after[p] for p in parents]
            state = None if states[0] is None else torch.stack(states)
            logits, new_state = step(depth + 1, pool.tokens[frontier], state)
            for i, f in enumerate(frontier):
                state_after[f] = None if new_state is None else new_state[i]
            return self._perturbed(logits.float(), depth + 1, noise).cpu()

        return build_dynamic_tree(self._perturbed(root[0].float(), 1, noise).cpu(), expand, self.tree_top_k,
                                  self.max_drafts, self.tree_tokens)
