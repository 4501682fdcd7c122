"""EAGLE-3 proposer: the EAGLE-2 dynamic draft tree grown by the one-layer drafter.

Context (official EAGLE convention): drafter row j pairs the target feature of token j
(fc over the three taps) with the embedding of token j+1, sits at position j and slot j, and
predicts token j+2. After each round the committed tokens c_0..c_{n-1} (anchor + accepted drafts)
and the token emitted after them give n new rows (feature(c_i), c_{i+1}) with c_n = the new anchor;
the last row's logits are the root distribution of the next tree and its output `out` the hidden
state its children are expanded from.

Tree growth (`specrt.runtime.tree.build_dynamic_tree`): a node at depth d is expanded by one drafter
row (its parent's `out`, its own token) at position context_length - 1 + d, in a scratch slot past
the committed context, attending to the committed context, its ancestors' scratch slots and itself.
Scratch rows are never committed: the next `observe` rewrites the context from target features.

Children are the top-k of each node (deterministic), so verification at T > 0 treats them as
point masses (`draft_probs` None): lossless, see `specrt.runtime.verify`.

Seeded rows (`couples_noise`): every level is chosen on logits / T + the noise verification will
add at that depth (`specrt.runtime.seeded.DraftNoise`, gathered at the draft vocabulary's target
ids): the chain's token, or a tree node's top-k children, so the top child is the draft most likely
to be the target's seeded token. Survivals stay the drafter's own probabilities.

Chains (top_k = 1, what int8-activation engines and small CPU verify budgets use) skip the tree
builder: one argmax per level gives the same drafts and survivals (argmax takes the first of equal
maxima, as the builder's stable order does) without its per-level bookkeeping, which on a CPU
round of ~15 ms was a visible share. A chain also stops early where the drafter's own path
probability (the survival) falls below `threshold`, or where the caller's `stop_rule` says deeper
levels cannot pay for their verify rows (`verify_length.py`, greedy rounds sized by measured costs):
every level not drafted saves a drafter call and a verify row, and the stop depends only on the
drafter, past records and past times, never on the target's output for this step, so verification
stays lossless (as DSpark's confidence truncation).
"""

from __future__ import annotations

import math

import torch

from specrt.export.models.eagle3 import Eagle3Drafter
from specrt.runtime.proposers.base import Proposal
from specrt.runtime.proposers.block import pad_rows
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tree import DraftTree, build_dynamic_tree


class Eagle3Proposer:
    name = "eagle3"
    couples_noise = True  # seeded rows draft on their verification's noise (module docstring)

    def __init__(self, drafter: Eagle3Drafter, top_k: int = 4, depth: int = 4, total_tokens: int = 16,
                 threshold: float = 0.0) -> None:
        self.drafter = drafter
        self.threshold = float(threshold)  # chains only: stop where the path probability drops below it
        # chains only: called with the conditional confidences of the levels drafted so far, True stops
        # drafting deeper (the caller's cost-aware sizing, `verify_length.py`); None: draft every level
        self.stop_rule = None
        self.tap_layers = tuple(drafter.config.tap_layers)
        self.top_k, self.depth, self.total_tokens = int(top_k), int(depth), int(total_tokens)
        self.max_drafts = self.total_tokens - 1
        self.device = drafter.device if hasattr(drafter, "device") else drafter.fc.weight.device
        # target id of each draft id (the builder stores target ids in the tree)
        self.token_map = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size, device=self.device)).cpu()
        self.vocab_size = int(drafter.config.vocab_size)  # the target's: the noise is drawn over it
        self.scratch = self.top_k * max(self.depth - 1, 0)

    def reset(self, batch_size: int, capacity: int) -> None:
        self.batch_size = batch_size
        self.k_cache, self.v_cache = self.drafter.new_cache(batch_size, capacity + self.scratch + 1)
        self.lengths = [0] * batch_size
        self.root_logits: list[torch.Tensor | None] = [None] * batch_size
        self.root_hidden: list[torch.Tensor | None] = [None] * batch_size

    def context_length(self, row: int) -> int:
        return self.lengths[row]

    @torch.inference_mode()
    def observe(self, rows, tokens, taps, next_tokens) -> None:
        ids, feats, positions = [], [], []
        for b, toks, tap, nxt in zip(rows, tokens, taps, next_tokens):
            ids.append(torch.tensor(list(toks[1:]) + [int(nxt)], dtype=torch.long))
            feats.append(tap)
            positions.append(torch.arange(self.lengths[b], self.lengths[b] + len(toks)))
        if list(rows) == list(range(self.batch_size)):
            groups = [(list(rows), self.k_cache, self.v_cache)]
        else:
            groups = [([b], self.k_cache[:, b:b + 1], self.v_cache[:, b:b + 1]) for b in rows]
        index = {b: i for i, b in enumerate(rows)}
        for group, k_cache, v_cache in groups:
            sel = [index[b] for b in group]
            id_batch, counts = pad_rows([ids[i] for i in sel])
            feat_batch, _ = pad_rows([feats[i] for i in sel])
            pos_batch, _ = pad_rows([positions[i] for i in sel])
            starts = torch.tensor([self.lengths[b] for b in group])
            window = int(pos_batch.max()) + 1
            slot = torch.arange(window)[None, None, :]
            # committed context, plus the new rows up to and including each row's own position
            mask = (slot < starts[:, None, None]) | (slot <= pos_batch[:, :, None])
            dev = self.device
            last_rows = torch.tensor([[c - 1] for c in counts])  # the next draft reads each row's last logits only
            logits, out = self.drafter(
                id_batch.to(dev), self.drafter.fuse(feat_batch.to(dev)), pos_batch.to(dev), mask.to(dev),
                k_cache, v_cache, pos_batch.to(dev), last_rows.to(dev),
            )
            for j, b in enumerate(group):
                last = counts[j] - 1
                self.root_logits[b] = logits[j, 0]
                self.root_hidden[b] = out[j, last]
                self.lengths[b] += counts[j]

    @torch.inference_mode()
    def propose(self, rows, anchors, sampling: SamplingParams, generator, noise=None) -> list[Proposal]:
        noise = noise if noise is not None else [None] * len(rows)
        if self.top_k == 1:
            return [self._chain(b, n) for b, n in zip(rows, noise)]
        return [self._tree(b, n) for b, n in zip(rows, noise)]

    def _scores(self, logits: torch.Tensor, depth: int, noise) -> torch.Tensor:
        """What a level is chosen on: the logits, or a seeded row's perturbed scores at `depth`."""
        if noise is None:
            return logits
        return noise.scores(logits, depth, self.vocab_size, self.token_map.to(logits.device))

    def _chain(self, b: int, noise=None) -> Proposal:
        """The top-1 path, depth min(depth, total_tokens - 1): the tree builder's result for top_k 1."""
        base = self.lengths[b]
        length = min(self.depth, self.total_tokens - 1)
        k_cache, v_cache = self.k_cache[:, b:b + 1], self.v_cache[:, b:b + 1]
        logits, hidden = self.root_logits[b], self.root_hidden[b]
        dev = self.device
        tokens: list[int] = []
        cum, cums = 0.0, []
        stop = math.log(self.threshold) if self.threshold > 0 else float("-inf")
        for level in range(1, length + 1):
            logp = torch.log_softmax(logits.float(), dim=-1)
            best = int(torch.argmax(logp if noise is None else self._scores(logits, level, noise)))
            cum += float(logp[best])
            if cum == float("-inf") or cum < stop:
                break
            tokens.append(int(self.token_map[best]))
            cums.append(cum)
            if level == length:
                break
            if self.stop_rule is not None and self.stop_rule([math.exp(b - a) for a, b in zip([0.0] + cums, cums)]):
                break  # deeper levels cannot pay: their drafter calls are saved too
            # node `level - 1` sits in scratch slot base + level - 1 at position base - 1 + level and
            # sees the committed context and the chain so far (its ancestors' slots and its own)
            slot = base + level - 1
            mask = torch.ones(1, 1, slot + 1, dtype=torch.bool)
            out_logits, out = self.drafter(
                torch.tensor([[tokens[-1]]], device=dev), hidden[None, None], torch.tensor([[base - 1 + level]], device=dev),
                mask.to(dev), k_cache, v_cache, torch.tensor([[slot]], device=dev),
            )
            logits, hidden = out_logits[0, 0], out[0, 0]
        return Proposal.chain(torch.tensor(tokens, dtype=torch.long), None,
                              torch.tensor(cums, dtype=torch.float64).exp().float())

    def _tree(self, b: int, noise=None) -> Proposal:
        base = self.lengths[b]
        k_cache, v_cache = self.k_cache[:, b:b + 1], self.v_cache[:, b:b + 1]
        node_out: dict[int, torch.Tensor] = {}
        node_slot: dict[int, int] = {}
        dev = self.device

        def expand(frontier: list[int], pool: DraftTree) -> torch.Tensor:
            parents = pool.parents.tolist()
            depths = pool.depths.tolist()
            hidden, slots, positions, rows_visible = [], [], [], []
            for f in frontier:
                p = parents[f]
                hidden.append(self.root_hidden[b] if p < 0 else node_out[p])
                node_slot[f] = base + len(node_slot)
                slots.append(node_slot[f])
                positions.append(base - 1 + depths[f])
                visible, a = [node_slot[f]], p
                while a >= 0:  # ancestors were all expanded at earlier levels
                    visible.append(node_slot[a])
                    a = parents[a]
                rows_visible.append(visible)
            window = max(slots) + 1
            mask = torch.zeros(1, len(frontier), window, dtype=torch.bool)
            mask[:, :, :base] = True
            for i, visible in enumerate(rows_visible):
                mask[0, i, visible] = True
            ids = pool.tokens[frontier][None].to(dev)
            logits, out = self.drafter(
                ids, torch.stack(hidden)[None], torch.tensor([positions], device=dev), mask.to(dev),
                k_cache, v_cache, torch.tensor([slots], device=dev),
            )
            for i, f in enumerate(frontier):
                node_out[f] = out[0, i]
            return self._scores(logits[0], depths[frontier[0]] + 1, noise).cpu()  # a frontier is one level

        tree = build_dynamic_tree(
            self._scores(self.root_logits[b], 1, noise).cpu(), expand, self.top_k, self.depth, self.total_tokens, token_map=self.token_map
        )
        return Proposal(tree.tokens, tree.parents, None, is_chain=False, depth=tree.max_depth,
                        survival=tree.cum_logprobs.exp().float())
