"""Draft-tree bookkeeping (mask, positions, paths, KV rows) and the EAGLE-2 dynamic tree builder."""

from __future__ import annotations

import math

import pytest
import torch

from specrt.runtime.tree import (
    DraftTree,
    build_dynamic_tree,
    check_parents,
    children_lists,
    kv_keep_indices,
    node_depths,
    path_to,
    tree_attention_mask,
    tree_positions,
)
from specrt.runtime.verify import chain_parents


def _random_parents(g: torch.Generator, n: int) -> list[int]:
    return [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]


def _ancestors(i: int, parents: list[int]) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


def test_mask_positions_paths_against_ancestor_walks():
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        n = int(torch.randint(0, 15, (1,), generator=g))
        parents = _random_parents(g, n)
        par_t = torch.tensor(parents, dtype=torch.long)
        mask = tree_attention_mask(par_t)
        assert mask.shape == (n, n) and mask.dtype == torch.bool
        depth = [len(_ancestors(i, parents)) for i in range(n)]
        for i in range(n):
            anc = _ancestors(i, parents)
            for j in range(n):
                assert bool(mask[i, j]) == (j in anc)
        full = tree_attention_mask(parents, with_root=True)
        assert full.shape == (n + 1, n + 1)
        assert full[:, 0].all() and not full[0, 1:].any()
        assert torch.equal(full[1:, 1:], mask)
        base = int(torch.randint(0, 100, (1,), generator=g))
        assert tree_positions(par_t, base).tolist() == [base + d for d in depth]
        assert tree_positions(parents, base, with_root=True).tolist() == [base] + [base + d for d in depth]
        assert node_depths(parents) == depth
        for i in range(n):
            path = path_to(i, parents)
            assert set(path) == _ancestors(i, parents) and path == sorted(path)
            assert all(parents[b] == a for a, b in zip(path, path[1:])) and parents[path[0]] == -1
            assert kv_keep_indices(path) == [0] + [j + 1 for j in path]
        kids = children_lists(parents)
        assert sorted(c for row in kids for c in row) == list(range(n))
        for p, row in enumerate(kids):
            assert all(parents[c] == p - 1 for c in row)


def test_chain_is_a_tree():
    parents = chain_parents(4)
    assert tree_attention_mask(parents).equal(torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert tree_positions(parents, 10).tolist() == [11, 12, 13, 14]
    assert path_to(2, parents) == [0, 1, 2] and path_to(-1, parents) == []
    assert kv_keep_indices([0, 1, 2]) == [0, 1, 2, 3] and kv_keep_indices([]) == [0]


def test_hand_made_tree():
    #      root
    #     /    \
    #    0      1
    #   / \      \
    #  2   3      4
    #  |
    #  5
    parents = [-1, -1, 0, 0, 1, 2]
    mask = tree_attention_mask(parents).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert tree_positions(parents, 7).tolist() == [8, 8, 9, 9, 9, 10]
    assert path_to(5, parents) == [0, 2, 5]
    assert kv_keep_indices([0, 2, 5]) == [0, 1, 3, 6]


def test_bad_parents_are_rejected():
    for bad in ([0], [-1, 1], [-1, -2], [-1, 0, 3]):
        with pytest.raises(ValueError):
            check_parents(bad)
        with pytest.raises(ValueError):
            tree_attention_mask(bad)
    with pytest.raises(ValueError):
        path_to(3, [-1, 0])


# ----------------------------------------------------------------------------------- dynamic tree


def _log(probs: dict[int, float], vocab: int = 6) -> torch.Tensor:
    p = torch.zeros(vocab, dtype=torch.float64)
    for t, v in probs.items():
        p[t] = v
    assert abs(float(p.sum()) - 1.0) < 1e-12
    return p.log()


def _hand_expand(calls: list):
    """Children log-probs keyed by the token path of the frontier node."""
    table = {
        (0,): {2: 0.5, 3: 0.3, 0: 0.05, 1: 0.05, 4: 0.05, 5: 0.05},      # A -> C .5, D .3
        (1,): {4: 0.6, 5: 0.3, 0: 0.04, 1: 0.03, 2: 0.02, 3: 0.01},      # B -> E .6, F .3
        (0, 2): {0: 0.8, 1: 0.1, 2: 0.04, 3: 0.03, 4: 0.02, 5: 0.01},    # A C -> G .8, H .1
        (1, 4): {1: 0.4, 2: 0.35, 0: 0.1, 3: 0.1, 4: 0.03, 5: 0.02},     # B E -> I .4, J .35
    }

    def expand(frontier, pool):
        calls.append((list(frontier), pool.tokens.tolist(), pool.parents.tolist(), pool.depths.tolist()))
        toks = pool.tokens.tolist()
        return torch.stack([_log(table[tuple(toks[j] for j in path_to(f, pool.parents))]) for f in frontier])

    return expand


ROOT = {0: 0.55, 1: 0.35, 2: 0.04, 3: 0.03, 4: 0.02, 5: 0.01}  # A = 0 (.55), B = 1 (.35)


def test_build_dynamic_tree_hand_computed():
    # Level 1: A (.55), B (.35)                     pool ids 0, 1
    # Level 2: A->C .275, A->D .165, B->E .21, B->F .105  pool ids 2, 3, 4, 5; frontier = top 2 = C, E
    # Level 3: AC->G .22, AC->H .0275, BE->I .084, BE->J .0735  pool ids 6, 7, 8, 9
    # Best 5 overall: A .55, B .35, AC .275, ACG .22, BE .21 (next: AD .165) -> pool ids 0, 1, 2, 4, 6
    calls: list = []
    tree = build_dynamic_tree(_log(ROOT), _hand_expand(calls), top_k=2, depth=3, total_tokens=6)
    assert tree.tokens.tolist() == [0, 1, 2, 4, 0]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 2]
    assert tree.depths.tolist() == [1, 1, 2, 2, 3]
    assert tree.source_ids.tolist() == [0, 1, 2, 4, 6]
    assert torch.allclose(tree.cum_logprobs.exp(), torch.tensor([0.55, 0.35, 0.275, 0.21, 0.22], dtype=torch.float64))
    assert torch.allclose(tree.logprobs.exp(), torch.tensor([0.55, 0.35, 0.5, 0.6, 0.8], dtype=torch.float64))
    # expand saw the frontier ids and the pool so far (2 nodes, then 6)
    assert [c[0] for c in calls] == [[0, 1], [2, 4]]
    assert calls[0][1:] == ([0, 1], [-1, -1], [1, 1])
    assert calls[1][1:] == ([0, 1, 2, 3, 4, 5], [-1, -1, 0, 0, 1, 1], [1, 1, 2, 2, 2, 2])
    assert tree.max_depth == 3 and len(tree) == 5

    small = build_dynamic_tree(_log(ROOT), _hand_expand([]), top_k=2, depth=3, total_tokens=4)
    assert small.tokens.tolist() == [0, 1, 2] and small.parents.tolist() == [-1, -1, 0]
    everything = build_dynamic_tree(_log(ROOT), _hand_expand([]), top_k=2, depth=3, total_tokens=100)
    assert everything.source_ids.tolist() == list(range(10))
    assert everything.parents.tolist() == [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]
    one_level = build_dynamic_tree(_log(ROOT), _hand_expand([]), top_k=3, depth=1, total_tokens=10)
    assert one_level.tokens.tolist() == [0, 1, 2] and one_level.parents.tolist() == [-1, -1, -1]


def test_token_map_and_raw_logits():
    calls: list = []
    token_map = torch.tensor([100, 101, 102, 103, 104, 105])
    expand = _hand_expand(calls)

    def mapped_expand(frontier, pool):  # the drafter sees target ids; undo the map for the table
        inv = DraftTree(pool.tokens - 100, pool.parents, pool.depths, pool.cum_logprobs, pool.logprobs)
        return expand(frontier, inv) + 3.0  # shifted log-probs = logits: renormalised inside
    tree = build_dynamic_tree(_log(ROOT) * 1.0 + 7.0, mapped_expand, 2, 3, 6, token_map=token_map)
    assert tree.tokens.tolist() == [100, 101, 102, 104, 100]
    assert torch.allclose(tree.cum_logprobs.exp(), torch.tensor([0.55, 0.35, 0.275, 0.21, 0.22], dtype=torch.float64))


def test_parent_wins_ties_with_its_child():
    # the root is sure of token 3, and token 3 is sure of token 4: A (log 1 = 0) and A->4 (0 + 0) tie
    root = torch.full((6,), float("-inf"))
    root[3] = 0.0

    def expand(frontier, pool):
        out = torch.full((len(frontier), 6), float("-inf"))
        out[:, 4] = 0.0
        return out

    tree = build_dynamic_tree(root, expand, top_k=2, depth=4, total_tokens=2)
    assert tree.tokens.tolist() == [3] and tree.parents.tolist() == [-1]
    tree = build_dynamic_tree(root, expand, top_k=2, depth=4, total_tokens=10)
    # zero-probability candidates are never selected: just the certain chain 3, 4, 4, 4
    assert tree.tokens.tolist() == [3, 4, 4, 4] and tree.parents.tolist() == [-1, 0, 1, 2]


def _reference_eagle2(root: torch.Tensor, table, top_k: int, depth: int, total: int):
    """Independent plain-Python EAGLE-2: returns (tokens, parents) of the selected tree."""
    lp = torch.log_softmax(root.double(), -1).tolist()
    pool = []  # (score, id, token, parent)
    ranked = sorted(range(len(lp)), key=lambda t: (-lp[t], t))[:top_k]
    for t in ranked:
        pool.append((lp[t], len(pool), t, -1))
    frontier = [p[1] for p in pool]
    for level in range(2, depth + 1):
        new = []
        for f in frontier:
            path = []
            node = f
            while node >= 0:
                path.append(pool[node][2])
                node = pool[node][3]
            child_lp = torch.log_softmax(table(tuple(reversed(path))).double(), -1).tolist()
            for t in sorted(range(len(child_lp)), key=lambda t: (-child_lp[t], t))[:top_k]:
                entry = (pool[f][0] + child_lp[t], len(pool), t, f)
                pool.append(entry)
                new.append(entry)
        frontier = [e[1] for e in sorted(new, key=lambda e: (-e[0], e[1]))[:top_k]]
    chosen = sorted(e[1] for e in sorted(pool, key=lambda e: (-e[0], e[1]))[: total - 1])
    index = {old: i for i, old in enumerate(chosen)}
    return [pool[i][2] for i in chosen], [index[pool[i][3]] if pool[i][3] >= 0 else -1 for i in chosen]


def test_build_dynamic_tree_random_against_reference_and_invariants():
    g = torch.Generator().manual_seed(3)
    vocab = 9
    for trial in range(40):
        cache: dict = {}

        def table(path):
            if path not in cache:
                cache[path] = torch.randn(vocab, generator=g, dtype=torch.float64) * 2
            return cache[path]

        top_k = int(torch.randint(1, 5, (1,), generator=g))
        depth = int(torch.randint(1, 6, (1,), generator=g))
        total = int(torch.randint(1, 30, (1,), generator=g))
        root = torch.randn(vocab, generator=g, dtype=torch.float64) * 2

        def expand(frontier, pool):
            toks = pool.tokens.tolist()
            return torch.stack([table(tuple(toks[j] for j in path_to(f, pool.parents))) for f in frontier])

        tree = build_dynamic_tree(root, expand, top_k, depth, total)
        ref_tokens, ref_parents = _reference_eagle2(root, table, top_k, depth, total)
        assert tree.tokens.tolist() == ref_tokens and tree.parents.tolist() == ref_parents
        n = len(tree)
        pool_size = top_k + (depth - 1) * top_k * top_k
        assert n == min(total - 1, pool_size)  # node budget respected (and used)
        parents = check_parents(tree.parents)  # parents before children
        assert tree.depths.tolist() == node_depths(parents) and tree.max_depth <= depth
        for i, p in enumerate(parents):
            parent_cum = 0.0 if p < 0 else float(tree.cum_logprobs[p])
            assert math.isclose(float(tree.cum_logprobs[i]), parent_cum + float(tree.logprobs[i]), abs_tol=1e-9)
            assert float(tree.cum_logprobs[i]) <= parent_cum + 1e-12
        kids = children_lists(parents)
        for row in kids:  # siblings are distinct tokens
            toks = [int(tree.tokens[c]) for c in row]
            assert len(toks) == len(set(toks)) and len(toks) <= top_k


def test_build_dynamic_tree_checks_expand_output():
    with pytest.raises(ValueError):
        build_dynamic_tree(torch.zeros(5), lambda f, pool: torch.zeros(len(f) + 1, 5), 2, 2, 5)
    with pytest.raises(ValueError):
        build_dynamic_tree(torch.zeros(1, 5), lambda f, pool: torch.zeros(len(f), 5), 2, 2, 5)
    with pytest.raises(ValueError):
        build_dynamic_tree(torch.zeros(5), lambda f, pool: torch.zeros(len(f), 5), 0, 2, 5)


def test_top_k_stable_equals_a_stable_sort_with_ties():
    from specrt.runtime.tree import _top_k_stable

    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (6, 40), generator=gen).double()  # many ties
    scores[0, :] = float("-inf")
    scores[0, 7] = 0.0  # fewer finite entries than k: -inf ties still go by index
    for k in (1, 3, 8):
        vals, idx = _top_k_stable(scores, k)
        ref = torch.sort(scores, dim=-1, descending=True, stable=True)
        assert torch.equal(idx, ref.indices[:, :k])
        assert torch.equal(vals, ref.values[:, :k])
