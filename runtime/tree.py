"""Draft trees: the EAGLE-2 dynamic tree and the index bookkeeping every tree drafter needs.

Format (shared with `specrt.runtime.verify`)
--------------------------------------------
A draft tree of N nodes is given by `tokens: LongTensor[N]` and `parents: LongTensor[N]`. Nodes are
numbered 0..N-1 in topological order (a parent always has a smaller index than its children);
`parents[i] == -1` means node i is a child of the root. The root is the anchor: the last token that
is already part of the output (the previous round's bonus token), so it is not a node.

The target verifies the input [anchor, node_0, ..., node_{N-1}] in one forward pass: input row 0
is the anchor, row i+1 is node i. Each row attends to the cache plus its ancestors-or-self inside
the tree (`tree_attention_mask`) and sits at position base + depth (`tree_positions`), where base
is the anchor's position and the anchor has depth 0, so a child of the root has depth 1 and sits
right after the anchor, exactly where it would sit in a plain sequence.

After verification the accepted path (a list of node indices, root excluded) decides which rows of
the verify input the target's KV cache keeps: `kv_keep_indices(path) = [0] + [i + 1 for i in path]`
(the anchor and the accepted nodes, in order); the loop gathers those rows into contiguous slots.
The bonus token is not in the cache: it is the next round's anchor.

EAGLE-2 dynamic tree (`build_dynamic_tree`)
-------------------------------------------
Reference: SafeAILab/EAGLE (EAGLE-2, arXiv 2406.16858; EAGLE-3, arXiv 2503.01840). The drafter is
model specific, so the tree builder only sees log-probabilities:

1. Level 1: the top_k tokens of the root's distribution become the first frontier.
2. Levels 2..depth: `expand(frontier, tree)` runs one drafter step for the frontier nodes and
   returns their children's log-probs; each frontier node proposes its top_k children, every
   proposed child joins the candidate pool with cumulative log-prob = parent's + its own, and the
   global top_k of the new level (by cumulative log-prob) becomes the next frontier.
3. Finally the best `total_tokens - 1` candidates of the whole pool (every level) by cumulative
   log-prob form the tree (`total_tokens` counts the anchor, as in EAGLE's `total_token`).

Cumulative log-probs never increase along a path (log-probs are <= 0), and ties are broken by
creation order, in which a parent always precedes its children; so whenever a node is selected its
parent ranks ahead of it and is selected too: the result is a proper tree. Nodes are renumbered in
creation order, which is topological. `depth` is the maximum node depth (tree levels below the
anchor), so `expand` is called depth - 1 times; EAGLE's code calls the same knob `depth` but counts
only the expansions (its depth 5 = our depth 6). Zero-probability candidates (-inf) are never
selected, so a tree can have fewer than total_tokens - 1 nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = [
    "DraftTree",
    "ExpandFn",
    "build_dynamic_tree",
    "check_parents",
    "children_lists",
    "node_depths",
    "tree_attention_mask",
    "tree_positions",
    "path_to",
    "kv_keep_indices",
]


def _as_list(parents: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(parents, torch.Tensor):
        if parents.dim() != 1:
            raise ValueError(f"parents must be 1-D, got shape {tuple(parents.shape)}")
        return [int(p) for p in parents.tolist()]
    return [int(p) for p in parents]


def check_parents(parents: torch.Tensor | Sequence[int]) -> list[int]:
    """Validate the tree format (-1 <= parents[i] < i) and return parents as a Python list."""
    plist = _as_list(parents)
    for i, p in enumerate(plist):
        if not -1 <= p < i:
            raise ValueError(
                f"parents[{i}] = {p}: nodes must be in topological order (-1 <= parent < own index)"
            )
    return plist


def children_lists(parents: torch.Tensor | Sequence[int]) -> list[list[int]]:
    """children[0] = children of the root, children[i + 1] = children of node i (index order)."""
    plist = check_parents(parents)
    children: list[list[int]] = [[] for _ in range(len(plist) + 1)]
    for i, p in enumerate(plist):
        children[p + 1].append(i)
    return children


def node_depths(parents: torch.Tensor | Sequence[int]) -> list[int]:
    """Depth of every node; a child of the root (the anchor, depth 0) has depth 1."""
    plist = check_parents(parents)
    depths: list[int] = []
    for p in plist:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def tree_attention_mask(parents: torch.Tensor | Sequence[int], with_root: bool = False) -> torch.Tensor:
    """BoolTensor[N, N]: mask[i, j] is True iff node j is an ancestor of node i or i itself.

    with_root=True returns the [N+1, N+1] mask of the verify input [anchor, node_0, ...]: row and
    column 0 are the anchor, which every row sees (it is everybody's ancestor) and which sees only
    itself. Attention to the already-cached context is not part of this mask (always allowed).
    """
    plist = check_parents(parents)
    n = len(plist)
    device = parents.device if isinstance(parents, torch.Tensor) else None
    off = 1 if with_root else 0
    rows: list[list[bool]] = []
    for i, p in enumerate(plist):
        row = list(rows[p]) if p >= 0 else [True] * off + [False] * n
        row[i + off] = True
        rows.append(row)
    if with_root:
        rows.insert(0, [True] + [False] * n)
    if not rows:
        return torch.zeros((0, 0), dtype=torch.bool, device=device)
    return torch.tensor(rows, dtype=torch.bool, device=device)


def tree_positions(parents: torch.Tensor | Sequence[int], base: int, with_root: bool = False) -> torch.Tensor:
    """LongTensor[N]: position of every node = base + depth, where `base` is the anchor's position.

    The anchor has depth 0, a child of the root depth 1, so a chain gets base+1, base+2, ... as in
    plain decoding. with_root=True prepends the anchor's own position (base): LongTensor[N+1].
    """
    depths = node_depths(parents)
    device = parents.device if isinstance(parents, torch.Tensor) else None
    values = ([0] if with_root else []) + depths
    return torch.tensor(values, dtype=torch.long, device=device) + int(base)


def path_to(node: int, parents: torch.Tensor | Sequence[int]) -> list[int]:
    """Node indices from the depth-1 ancestor down to `node` (root excluded); [] for node -1."""
    plist = check_parents(parents)
    if not -1 <= node < len(plist):
        raise ValueError(f"node {node} is not in a tree of {len(plist)} nodes")
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = plist[node]
    path.reverse()
    return path


def kv_keep_indices(path: Sequence[int]) -> list[int]:
    """Rows of the verify input [anchor, node_0, ...] the target cache keeps: anchor + accepted path."""
    return [0] + [int(i) + 1 for i in path]


@dataclass
class DraftTree:
    """A draft tree in the verification format, with the drafter's scores.

    tokens[i]: token id of node i (target vocabulary if a token_map was given)
    parents[i]: parent node index, -1 for a child of the root (the anchor)
    depths[i]: 1 for a child of the root
    cum_logprobs[i]: sum of the draft log-probs along the path root -> i (the EAGLE-2 score)
    logprobs[i]: the draft log-prob of token i given its parent (the local one)
    source_ids[i]: for trees from build_dynamic_tree, the node's id in the candidate pool that
        `expand` saw (so a drafter can map its per-node state); otherwise arange(N)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    cum_logprobs: torch.Tensor
    logprobs: torch.Tensor
    source_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in ("parents", "depths", "cum_logprobs", "logprobs"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"DraftTree.{name} must have shape ({n},), got {tuple(getattr(self, name).shape)}")
        if self.source_ids is None:
            self.source_ids = torch.arange(n, dtype=torch.long)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.size

    @property
    def max_depth(self) -> int:
        return int(self.depths.max().item()) if self.size else 0

    def attention_mask(self, with_root: bool = False) -> torch.Tensor:
        return tree_attention_mask(self.parents, with_root=with_root)

    def positions(self, base: int, with_root: bool = False) -> torch.Tensor:
        return tree_positions(self.parents, base, with_root=with_root)

    def path_to(self, node: int) -> list[int]:
        return path_to(node, self.parents)

    def children(self) -> list[list[int]]:
        return children_lists(self.parents)


def _top_k_stable(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of [R, V] scores: the k largest, descending, ties broken by the lower index.

    Same result as a stable descending sort cut to k, without sorting the whole vocabulary (a
    full sort of 8192 doubles per level was ~2 ms of a CPU drafting round): topk finds the k-th
    value, then only the entries at or above it are sorted stably.
    """
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]
    vals, idx = [], []
    for row, bound in zip(scores, kth):
        cand = torch.nonzero(row >= bound).squeeze(1)  # ascending index order
        order = torch.sort(row[cand], descending=True, stable=True).indices[:k]
        vals.append(row[cand[order]])
        idx.append(cand[order])
    return torch.stack(vals), torch.stack(idx)


# expand(frontier, pool) -> log-probs [len(frontier), V] of the children of each frontier node.
# `frontier` holds node ids of `pool` (the candidate tree so far, ids stable across calls).
ExpandFn = Callable[[list[int], DraftTree], torch.Tensor]


def build_dynamic_tree(
    root_logprobs: torch.Tensor,
    expand: ExpandFn,
    top_k: int,
    depth: int,
    total_tokens: int,
    token_map: torch.Tensor | None = None,
) -> DraftTree:
    """EAGLE-2 dynamic draft tree (see the module docstring).

    root_logprobs: [V] log-probs of the root's children (the drafter's first step after the anchor).
    expand(frontier, pool): called once per level 2..depth with the frontier's pool node ids (in
        frontier order) and the candidate pool so far (a DraftTree over every candidate created
        until now: tokens, parents, depths, scores; parents precede children). It returns
        [len(frontier), V] log-probs of each frontier node's children. Inputs are log-softmaxed
        again here, so raw logits are accepted too.
    top_k: children per expanded node and frontier width; depth: maximum node depth (>= 1);
    total_tokens: tree size counting the anchor, so at most total_tokens - 1 nodes.
    token_map: optional [V] LongTensor mapping the drafter's vocabulary to target ids (EAGLE-3's
        draft vocab: target = draft + d2t[draft]); tokens are stored (and shown to `expand`) mapped.

    Returns the selected nodes renumbered in creation order (topological), with source_ids = pool ids.
    """
    if root_logprobs.dim() != 1:
        raise ValueError(f"root_logprobs must be [V], got shape {tuple(root_logprobs.shape)}")
    if top_k < 1 or depth < 1 or total_tokens < 1:
        raise ValueError(f"top_k, depth and total_tokens must be >= 1 (got {top_k}, {depth}, {total_tokens})")
    vocab = root_logprobs.shape[0]
    k = min(int(top_k), vocab)

    # the pool, as Python lists (ids = creation order)
    toks: list[int] = []
    pars: list[int] = []
    deps: list[int] = []
    cums: list[float] = []
    locs: list[float] = []

    def mapped(t: int) -> int:
        return int(token_map[t]) if token_map is not None else t

    def pool_tree() -> DraftTree:
        return DraftTree(
            tokens=torch.tensor(toks, dtype=torch.long),
            parents=torch.tensor(pars, dtype=torch.long),
            depths=torch.tensor(deps, dtype=torch.long),
            cum_logprobs=torch.tensor(cums, dtype=torch.float64),
            logprobs=torch.tensor(locs, dtype=torch.float64),
        )

    root = torch.log_softmax(root_logprobs.detach().double().cpu(), dim=-1)
    vals, idx = _top_k_stable(root[None], k)
    frontier: list[int] = []
    for v, t in zip(vals[0].tolist(), idx[0].tolist()):
        frontier.append(len(toks))
        toks.append(mapped(t))
        pars.append(-1)
        deps.append(1)
        cums.append(v)
        locs.append(v)

    for level in range(2, depth + 1):
        frontier = [f for f in frontier if cums[f] > float("-inf")]
        if not frontier:
            break
        out = expand(list(frontier), pool_tree())
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != len(frontier):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"expand must return [len(frontier)={len(frontier)}, V] log-probs, got {shape}")
        logp = torch.log_softmax(out.detach().double().cpu(), dim=-1)
        kk = min(k, logp.shape[-1])
        cvals_t, cidx_t = _top_k_stable(logp, kk)
        cvals, cidx = cvals_t.tolist(), cidx_t.tolist()
        new_ids: list[int] = []
        for row, parent in enumerate(frontier):
            for v, t in zip(cvals[row], cidx[row]):
                new_ids.append(len(toks))
                toks.append(mapped(t))
                pars.append(parent)
                deps.append(level)
                cums.append(cums[parent] + v)
                locs.append(v)
        # global top_k of this level by cumulative log-prob; ties -> creation order
        level_scores = torch.tensor([cums[i] for i in new_ids], dtype=torch.float64)
        order = torch.sort(level_scores, descending=True, stable=True).indices[:k].tolist()
        frontier = [new_ids[j] for j in order]

    # best total_tokens - 1 candidates overall; ties -> creation order, so parents win over children
    scores = torch.tensor(cums, dtype=torch.float64)
    order = torch.sort(scores, descending=True, stable=True).indices.tolist()
    chosen = sorted(i for i in order[: max(total_tokens - 1, 0)] if cums[i] > float("-inf"))
    new_index = {old: new for new, old in enumerate(chosen)}
    sel_parents = []
    for i in chosen:
        p = pars[i]
        if p >= 0 and p not in new_index:  # cannot happen (see docstring); guard against NaN scores
            raise ValueError("draft tree selection dropped a parent: are there NaN log-probs?")
        sel_parents.append(new_index[p] if p >= 0 else -1)
    return DraftTree(
        tokens=torch.tensor([toks[i] for i in chosen], dtype=torch.long),
        parents=torch.tensor(sel_parents, dtype=torch.long),
        depths=torch.tensor([deps[i] for i in chosen], dtype=torch.long),
        cum_logprobs=torch.tensor([cums[i] for i in chosen], dtype=torch.float64),
        logprobs=torch.tensor([locs[i] for i in chosen], dtype=torch.float64),
        source_ids=torch.tensor(chosen, dtype=torch.long),
    )
