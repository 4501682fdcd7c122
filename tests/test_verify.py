"""Verification: greedy against direct computations, sampling proven lossless by exact enumeration.

The exact tests run the REAL verify functions with a `Coins` object that enumerates every random
branch (each accept/reject and each categorical draw) with its probability, and enumerate every draft
outcome with its probability, so they compute the exact distribution of the emitted tokens, then
complete short rounds with the target itself (a round that emits L tokens is followed by target
sampling, which is what the next lossless rounds amount to). That distribution must equal the
target's joint distribution of the first n tokens to 1e-9. Wrong rules (no ratio test, correction
sampled from p instead of the residual, wrong proposal q) run through the same harness and must be
caught. A chi-square test with a real torch.Generator covers the random-number path.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

from specrt.runtime import verify as V
from specrt.runtime.tree import build_dynamic_tree, path_to
from specrt.runtime.verify import (
    chain_parents,
    verify_chain_greedy,
    verify_chain_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)

# ------------------------------------------------------------------------------------------ harness


class _Scripted:
    """Coins that follow a script of branch choices and record the branches not taken."""

    def __init__(self, script: list[int], always_accept: bool = False) -> None:
        self.script = script
        self.pos = 0
        self.prob = 1.0
        self.pending: list[list[int]] = []
        self.always_accept = always_accept

    def _choose(self, options: list[tuple[object, float]]):
        options = [(v, w) for v, w in options if w > 0.0]
        assert options, "a random decision with no possible outcome"
        if self.pos < len(self.script):
            pick = self.script[self.pos]
        else:
            pick = 0
            done = self.script[: self.pos]
            self.pending.extend(done + [alt] for alt in range(1, len(options)))
            self.script = done + [0]
        self.pos += 1
        value, weight = options[pick]
        self.prob *= weight
        return value

    def accept(self, prob: float) -> bool:
        if self.always_accept:
            return True
        prob = min(max(prob, 0.0), 1.0)
        return self._choose([(True, prob), (False, 1.0 - prob)])

    def draw(self, probs: torch.Tensor) -> int:
        probs = probs.double()
        probs = probs / probs.sum()
        return self._choose([(i, w) for i, w in enumerate(probs.tolist())])


def enumerate_outcomes(fn, always_accept: bool = False) -> dict:
    """{fn(coins) result: probability} over every random branch fn can take."""
    out: dict = defaultdict(float)
    stack: list[list[int]] = [[]]
    while stack:
        coins = _Scripted(stack.pop(), always_accept)
        result = fn(coins)
        out[_freeze(result)] += coins.prob
        stack.extend(coins.pending)
    return out


def _freeze(x):
    return tuple(_freeze(v) for v in x) if isinstance(x, (list, tuple)) else x


class World:
    """A target p(. | prefix) and a drafter q(. | prefix) on a tiny vocabulary, fixed per prefix."""

    def __init__(self, vocab: int, seed: int, draft: str, target_zeros: int = 1) -> None:
        self.vocab, self.seed, self.draft, self.target_zeros = vocab, seed, draft, target_zeros
        self._p: dict = {}
        self._q: dict = {}

    def _gen(self, prefix: tuple, salt: int) -> torch.Generator:
        code = salt
        for t in prefix:
            code = code * (self.vocab + 1) + t + 1
        return torch.Generator().manual_seed(self.seed * 1_000_003 + code)

    def p(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self._p:
            g = self._gen(prefix, 1)
            logits = torch.randn(self.vocab, generator=g, dtype=torch.float64) * 1.5
            probs = torch.softmax(logits, -1)
            if self.target_zeros:  # a top-k'd target: some tokens impossible
                drop = torch.randperm(self.vocab, generator=g)[: self.target_zeros]
                probs[drop] = 0.0
                probs = probs / probs.sum()
            self._p[prefix] = probs
        return self._p[prefix]

    def q(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self._q:
            p = self.p(prefix)
            g = self._gen(prefix, 2)
            if self.draft == "good":  # close to p, but with mass where p has none
                q = 0.8 * p + 0.2 / self.vocab
            else:  # unrelated and sharp: mostly wrong
                q = torch.softmax(torch.randn(self.vocab, generator=g, dtype=torch.float64) * 3.0, -1)
            self._q[prefix] = q / q.sum()
        return self._q[prefix]

    def target_joint(self, n: int, prefix: tuple = ()) -> dict:
        out = {}
        for seq in itertools.product(range(self.vocab), repeat=n):
            prob = 1.0
            for i, t in enumerate(seq):
                prob *= float(self.p(prefix + seq[:i])[t])
            if prob > 0:
                out[seq] = prob
        return out

    def complete(self, emitted: tuple, n: int, weight: float, acc: dict) -> None:
        """Add weight * P(first n tokens | round emitted `emitted`, then target sampling)."""
        if len(emitted) >= n:
            acc[emitted[:n]] += weight
            return
        p = self.p(emitted)
        for t in range(self.vocab):
            if p[t] > 0:
                self.complete(emitted + (t,), n, weight * float(p[t]), acc)


# the exact tests agree to 1e-9 for correct rules; a wrong rule must be off by far more than that
DETECT = 1e-4


def _max_error(dist: dict, ref: dict) -> float:
    """Largest absolute difference between two distributions (each must sum to 1)."""
    keys = set(dist) | set(ref)
    err = max(abs(dist.get(k, 0.0) - ref.get(k, 0.0)) for k in keys)
    assert abs(sum(dist.values()) - 1.0) < 1e-9
    return err


def _sampled_chains(world: World, k: int):
    """Every draft chain of length k with its probability (drafts ~ q)."""
    def rec(prefix: tuple, prob: float):
        if len(prefix) == k:
            yield prefix, prob
            return
        q = world.q(prefix)
        for t in range(world.vocab):
            if q[t] > 0:
                yield from rec(prefix + (t,), prob * float(q[t]))
    yield from rec((), 1.0)


def exact_chain(world: World, k: int, n: int, mode: str = "sampled", q_override=None, always_accept=False) -> dict:
    """Exact distribution of the first n tokens with one chain round then target sampling."""
    acc: dict = defaultdict(float)
    if mode == "sampled":
        chains = list(_sampled_chains(world, k))
    else:  # deterministic drafts: the drafter's argmax
        prefix: tuple = ()
        for _ in range(k):
            prefix += (int(world.q(prefix).argmax()),)
        chains = [(prefix, 1.0)]
    for drafts, prob in chains:
        tokens = torch.tensor(drafts, dtype=torch.long)
        target = torch.stack([world.p(drafts[:i]) for i in range(k + 1)])
        if q_override == "none":
            qs = None
        elif q_override == "softmax" or mode == "sampled":
            qs = torch.stack([world.q(drafts[:i]) for i in range(k)])
        else:
            qs = None
        outcomes = enumerate_outcomes(lambda c: verify_chain_sampling(tokens, qs, target, c), always_accept)
        for (n_acc, tok), w in outcomes.items():
            world.complete(tuple(drafts[:n_acc]) + (tok,), n, prob * w, acc)
    return acc


# ------------------------------------------------------------------------------------- chain: exact


@pytest.mark.parametrize("draft", ["good", "bad"])
@pytest.mark.parametrize("seed", [0, 1])
def test_chain_sampling_is_lossless_exact(draft, seed):
    world = World(vocab=5, seed=seed, draft=draft)
    k, n = 2, 3
    assert _max_error(exact_chain(world, k, n), world.target_joint(n)) < 1e-9


def test_chain_sampling_three_drafts_exact():
    world = World(vocab=4, seed=7, draft="bad", target_zeros=1)
    assert _max_error(exact_chain(world, 3, 4), world.target_joint(4)) < 1e-9


def test_chain_sampling_deterministic_drafts_point_mass_exact():
    """Argmax drafts with draft_probs=None (point masses) are lossless too."""
    world = World(vocab=5, seed=3, draft="bad")
    assert _max_error(exact_chain(world, 3, 4, mode="argmax"), world.target_joint(4)) < 1e-9


def test_point_mass_verification_is_lossless_for_any_drafts():
    """draft_probs=None conditions on the drafted token: lossless even for sampled drafts (it only
    accepts less often than the true q would), so it is the safe choice when q is unknown."""
    world = World(vocab=5, seed=0, draft="bad")
    assert _max_error(exact_chain(world, 2, 3, q_override="none"), world.target_joint(3)) < 1e-9
    world4 = World(vocab=4, seed=11, draft="bad")
    dist = exact_tree_sampled(world4, [-1, -1, 0, 0], n=3, replacement=False, q_override="none")
    assert _max_error(dist, world4.target_joint(3)) < 1e-9


def test_chain_harness_catches_wrong_rules(monkeypatch):
    """The same exact test fails for rules that are not lossless (so it can fail)."""
    world = World(vocab=5, seed=0, draft="bad")
    ref = world.target_joint(3)
    # 1. accepting drafts without the ratio test
    assert _max_error(exact_chain(world, 2, 3, always_accept=True), ref) > DETECT
    # 2. argmax drafts verified with the drafter's softmax as q (they were not sampled from it)
    assert _max_error(exact_chain(world, 2, 3, mode="argmax", q_override="softmax"), ref) > DETECT
    # 3. correction sampled from p instead of normalize(max(p - q, 0))
    monkeypatch.setattr(V, "_residual", lambda p, q: p)
    assert _max_error(exact_chain(world, 2, 3), ref) > DETECT


# -------------------------------------------------------------------------------------- tree: exact


def _sample_tree_tokens(world: World, parents: list[int], replacement: bool):
    """Every token assignment of a fixed tree shape, children drawn from q (with or without
    replacement among siblings), with its probability and each node's proposal q_c."""
    n = len(parents)

    def rec(i: int, toks: list[int], qs: list[torch.Tensor], prob: float):
        if i == n:
            yield list(toks), list(qs), prob
            return
        prefix = tuple(toks[j] for j in path_to(parents[i], parents)) if parents[i] >= 0 else ()
        q = world.q(prefix).clone()
        if not replacement:
            for s in range(i):
                if parents[s] == parents[i]:
                    q[toks[s]] = 0.0
            q = q / q.sum()
        for t in range(world.vocab):
            if q[t] > 0:
                yield from rec(i + 1, toks + [t], qs + [q], prob * float(q[t]))

    yield from rec(0, [], [], 1.0)


def _tree_target(world: World, tokens: list[int], parents: list[int]) -> torch.Tensor:
    rows = [world.p(())]
    for i in range(len(tokens)):
        rows.append(world.p(tuple(tokens[j] for j in path_to(i, parents))))
    return torch.stack(rows)


def _accumulate_tree(world, tokens, parents, qs, prob, n, acc, always_accept=False):
    tok_t = torch.tensor(tokens, dtype=torch.long)
    par_t = torch.tensor(parents, dtype=torch.long)
    target = _tree_target(world, tokens, parents)
    outcomes = enumerate_outcomes(lambda c: verify_tree_sampling(tok_t, par_t, target, qs, c), always_accept)
    for (path, bonus), w in outcomes.items():
        world.complete(tuple(tokens[i] for i in path) + (bonus,), n, prob * w, acc)


def exact_tree_sampled(world: World, parents: list[int], n: int, replacement: bool, q_override=None) -> dict:
    acc: dict = defaultdict(float)
    for tokens, qs, prob in _sample_tree_tokens(world, parents, replacement):
        q_rows = None if q_override == "none" else torch.stack(qs)
        if q_override == "iid":  # WRONG for draws without replacement: ignores the earlier siblings
            q_rows = torch.stack(
                [world.q(tuple(tokens[j] for j in path_to(i, parents))[:-1]) for i in range(len(tokens))]
            )
        _accumulate_tree(world, tokens, parents, q_rows, prob, n, acc)
    return acc


def _eagle_tree(world: World, top_k: int, depth: int, total: int):
    """EAGLE-2 dynamic tree from the drafter's log-probs: deterministic top-k children."""
    def expand(frontier, pool):
        toks = pool.tokens.tolist()
        rows = []
        for f in frontier:
            prefix = tuple(toks[j] for j in path_to(f, pool.parents))
            rows.append(world.q(prefix).log())
        return torch.stack(rows)

    tree = build_dynamic_tree(world.q(()).log(), expand, top_k, depth, total)
    return tree.tokens.tolist(), tree.parents.tolist()


def exact_tree_topk(world: World, top_k: int, depth: int, total: int, n: int, q_override=None, always_accept=False):
    tokens, parents = _eagle_tree(world, top_k, depth, total)
    acc: dict = defaultdict(float)
    q_rows = None
    if q_override == "softmax":  # WRONG: the drafter's probabilities for top-k (deterministic) children
        q_rows = torch.stack([world.q(tuple(tokens[j] for j in path_to(i, parents))[:-1]) for i in range(len(tokens))])
    _accumulate_tree(world, tokens, parents, q_rows, 1.0, n, acc, always_accept)
    return acc, tokens, parents


@pytest.mark.parametrize("draft", ["good", "bad"])
def test_tree_sampling_without_replacement_is_lossless_exact(draft):
    world = World(vocab=4, seed=11, draft=draft)
    parents = [-1, -1, 0, 0]  # two children of the root, two grandchildren under the first
    dist = exact_tree_sampled(world, parents, n=3, replacement=False)
    assert _max_error(dist, world.target_joint(3)) < 1e-9


def test_tree_sampling_iid_children_is_lossless_exact():
    """SpecInfer: siblings drawn i.i.d. from the same q, each verified against the running residual."""
    world = World(vocab=4, seed=12, draft="bad")
    dist = exact_tree_sampled(world, [-1, -1, 1], n=3, replacement=True)
    assert _max_error(dist, world.target_joint(3)) < 1e-9


@pytest.mark.parametrize("draft,seed", [("good", 0), ("bad", 1), ("bad", 2)])
def test_tree_sampling_topk_point_mass_is_lossless_exact(draft, seed):
    """EAGLE-2 tree (deterministic top-k children, child_draft_probs=None), a different p per node."""
    world = World(vocab=5, seed=seed, draft=draft)
    dist, tokens, parents = exact_tree_topk(world, top_k=2, depth=3, total=7, n=4)
    assert len(tokens) == 6 and max(len(path_to(i, parents)) for i in range(6)) >= 2
    assert _max_error(dist, world.target_joint(4)) < 1e-9


def test_tree_harness_catches_wrong_rules(monkeypatch):
    world = World(vocab=5, seed=1, draft="bad")
    ref = world.target_joint(4)
    # 1. top-k children verified with the drafter's softmax as their q (they were not sampled from it)
    dist, _, _ = exact_tree_topk(world, 2, 3, 7, 4, q_override="softmax")
    assert _max_error(dist, ref) > DETECT
    # 2. no ratio test
    dist, _, _ = exact_tree_topk(world, 2, 3, 7, 4, always_accept=True)
    assert _max_error(dist, ref) > DETECT
    # 3. siblings drawn without replacement but verified as if i.i.d. (q_c = q, not renormalised)
    world4 = World(vocab=4, seed=11, draft="bad")
    dist = exact_tree_sampled(world4, [-1, -1, 0, 0], n=3, replacement=False, q_override="iid")
    assert _max_error(dist, world4.target_joint(3)) > DETECT
    # 4. correction from p instead of the residual
    monkeypatch.setattr(V, "_residual", lambda p, q: p)
    dist, _, _ = exact_tree_topk(world, 2, 3, 7, 4)
    assert _max_error(dist, ref) > DETECT


def test_chain_and_tree_sampling_agree_exactly():
    """verify_tree_sampling on chain_parents(k) has the same output law as verify_chain_sampling."""
    world = World(vocab=5, seed=5, draft="bad")
    k = 3
    for drafts, _ in list(_sampled_chains(world, k))[:20]:
        tokens = torch.tensor(drafts)
        target = torch.stack([world.p(drafts[:i]) for i in range(k + 1)])
        qs = torch.stack([world.q(drafts[:i]) for i in range(k)])
        chain = enumerate_outcomes(lambda c: verify_chain_sampling(tokens, qs, target, c))
        tree = enumerate_outcomes(lambda c: verify_tree_sampling(tokens, chain_parents(k), target, qs, c))
        as_chain = defaultdict(float)
        for (path, bonus), w in tree.items():
            assert list(path) == list(range(len(path)))
            as_chain[(len(path), bonus)] += w
        assert set(chain) == set(as_chain)
        for key in chain:
            assert abs(chain[key] - as_chain[key]) < 1e-12


# ------------------------------------------------------------------------------- torch RNG: chi-square


def _chi2_pvalue(counts: dict, expected: dict, total: int) -> float:
    for key, c in counts.items():
        assert expected.get(key, 0.0) > 0.0, f"impossible outcome {key} was emitted"
    stat = sum((counts.get(k, 0) - total * e) ** 2 / (total * e) for k, e in expected.items())
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _mc_chain(world: World, k: int, n: int, samples: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    counts: dict = defaultdict(int)
    for _ in range(samples):
        drafts: tuple = ()
        qs = []
        for _ in range(k):
            q = world.q(drafts)
            qs.append(q)
            drafts += (int(torch.multinomial(q, 1, generator=gen)),)
        target = torch.stack([world.p(drafts[:i]) for i in range(k + 1)]).float()
        n_acc, tok = verify_chain_sampling(torch.tensor(drafts), torch.stack(qs).float(), target, gen)
        out = drafts[:n_acc] + (tok,)
        while len(out) < n:
            out += (int(torch.multinomial(world.p(out), 1, generator=gen)),)
        counts[out[:n]] += 1
    return counts


def test_chain_sampling_chi_square_with_torch_generator(monkeypatch):
    world = World(vocab=4, seed=21, draft="bad", target_zeros=0)
    expected = world.target_joint(2)
    samples = 6000
    good = _chi2_pvalue(_mc_chain(world, 2, 2, samples, seed=1234), expected, samples)
    assert good > 1e-3
    monkeypatch.setattr(V, "_residual", lambda p, q: p)  # the wrong rule is rejected by the same test
    bad = _chi2_pvalue(_mc_chain(world, 2, 2, samples, seed=1234), expected, samples)
    assert bad < 1e-6


def test_tree_sampling_chi_square_with_torch_generator():
    world = World(vocab=4, seed=22, draft="bad", target_zeros=0)
    tokens, parents = _eagle_tree(world, top_k=2, depth=2, total=5)
    target = _tree_target(world, tokens, parents)
    tok_t, par_t = torch.tensor(tokens), torch.tensor(parents)
    gen = torch.Generator().manual_seed(99)
    counts: dict = defaultdict(int)
    samples = 6000  # smallest expected cell: 5.2
    for _ in range(samples):
        path, bonus = verify_tree_sampling(tok_t, par_t, target, None, gen)
        out = tuple(tokens[i] for i in path) + (bonus,)
        if len(out) < 2:
            out += (int(torch.multinomial(world.p(out), 1, generator=gen)),)
        counts[out[:2]] += 1
    assert _chi2_pvalue(counts, world.target_joint(2), samples) > 1e-3


def test_sampling_is_reproducible_with_a_seeded_generator():
    world = World(vocab=5, seed=4, draft="bad")
    tokens = torch.tensor([1, 2, 3])
    target = torch.stack([world.p((1, 2, 3)[:i]) for i in range(4)]).float()
    qs = torch.stack([world.q((1, 2, 3)[:i]) for i in range(3)]).float()
    runs = [[verify_chain_sampling(tokens, qs, target, g) for _ in range(50)]
            for g in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------- greedy


def test_verify_chain_greedy_matches_direct_computation():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        k = int(torch.randint(0, 6, (1,), generator=g))
        logits = torch.randn(k + 1, 11, generator=g)
        best = logits.argmax(-1)
        drafts = best[:k].clone()
        if k and trial % 3:
            m = int(torch.randint(0, k, (1,), generator=g))
            drafts[m] = (drafts[m] + 1 + int(torch.randint(0, 10, (1,), generator=g))) % 11
        expected_n = 0
        while expected_n < k and int(drafts[expected_n]) == int(best[expected_n]):
            expected_n += 1
        assert verify_chain_greedy(drafts, logits) == (expected_n, int(best[expected_n]))
        path, bonus = verify_tree_greedy(drafts, chain_parents(k), logits)
        assert path == list(range(expected_n)) and bonus == int(best[expected_n])


def _random_tree(g: torch.Generator, n: int, vocab: int):
    parents, tokens = [], []
    used: dict[int, set] = defaultdict(set)
    for i in range(n):
        p = int(torch.randint(-1, i, (1,), generator=g))
        choices = [t for t in range(vocab) if t not in used[p]]
        if not choices:
            p, choices = i - 1, list(range(vocab))
        t = choices[int(torch.randint(0, len(choices), (1,), generator=g))]
        used[p].add(t)
        parents.append(p)
        tokens.append(t)
    return tokens, parents


def test_verify_tree_greedy_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    vocab = 4  # small, so the argmax often matches and paths get deep
    for _ in range(300):
        n = int(torch.randint(0, 12, (1,), generator=g))
        tokens, parents = _random_tree(g, n, vocab)
        logits = torch.randn(n + 1, vocab, generator=g)
        best = logits.argmax(-1).tolist()
        # brute force: a node is on the greedy path iff every node on its root path matches the
        # argmax of its parent's row; the path is the deepest such node's root path
        valid = [all(tokens[j] == best[(parents[j] + 1)] for j in path_to(i, parents)) for i in range(n)]
        deepest = max((i for i in range(n) if valid[i]), key=lambda i: len(path_to(i, parents)), default=-1)
        expected_path = path_to(deepest, parents)
        expected_bonus = best[deepest + 1]
        path, bonus = verify_tree_greedy(torch.tensor(tokens, dtype=torch.long), parents, logits)
        assert (path, bonus) == (expected_path, expected_bonus)


def test_verify_tree_greedy_repeated_sibling_token_takes_the_first():
    logits = torch.full((4, 3), -5.0)
    logits[0, 2] = 5.0  # root wants token 2
    logits[2, 1] = 5.0  # node 1 would want 1, node 0 wants 0
    tokens = torch.tensor([2, 2, 1])
    path, bonus = verify_tree_greedy(tokens, torch.tensor([-1, -1, 1]), logits)
    assert path == [0] and bonus == int(logits[1].argmax())


def test_shapes_are_checked():
    with pytest.raises(ValueError):
        verify_chain_greedy(torch.tensor([1, 2]), torch.zeros(2, 5))
    with pytest.raises(ValueError):
        verify_chain_sampling(torch.tensor([1]), torch.zeros(2, 5), torch.zeros(2, 5))
    with pytest.raises(ValueError):
        verify_tree_sampling(torch.tensor([1, 2]), torch.tensor([-1, 1]), torch.zeros(3, 5), None)
    assert chain_parents(4).tolist() == [-1, 0, 1, 2]
    assert chain_parents(0).tolist() == []


def test_empty_drafts_sample_the_target():
    p = torch.tensor([[0.0, 1.0, 0.0]])
    empty = torch.tensor([], dtype=torch.long)
    assert verify_chain_sampling(empty, None, p, torch.Generator().manual_seed(0)) == (0, 1)
    assert verify_tree_sampling(torch.tensor([], dtype=torch.long), [], p, None) == ([], 1)
