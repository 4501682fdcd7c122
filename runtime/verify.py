"""Verification of drafts against the target: greedy and lossless sampling, for chains and trees.

Pure functions over one request (the loop calls them per row). Target rows: row 0 is the target's
prediction after the anchor, row i+1 its prediction after draft/node i. In sampling mode the target
distributions MUST be `specrt.runtime.sampling.probabilities(logits, params)` (temperature, top-k,
top-p): that is the distribution the output is exactly equal to.

Greedy (temperature 0)
----------------------
Chain: accept the longest prefix of drafts equal to the target's argmax; the bonus is the argmax
after it. Tree: from the root, step to the child whose token is the argmax of the current row
(the lowest-index one if siblings repeat a token) until none matches; the bonus is that row's argmax.

Sampling, chain (Leviathan et al. 2023; Chen et al. 2023)
---------------------------------------------------------
Draft x_i was drawn from q_i. Accept it with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection emit a sample of normalize(max(p_i - q_i, 0)) and stop; if all k pass, emit a sample of
p_k. `draft_probs=None` means the drafts were chosen deterministically (argmax): q_i is then the
point mass on x_i (accept with probability p_i(x_i); on rejection sample p_i without x_i).

Sampling, tree: recursive multi-candidate rejection (SpecInfer, Miao et al. 2024; EAGLE)
------------------------------------------------------------------------------------------
Start at the root with p = target row 0. Try the children of the current node in index order; child
c, with token x and proposal q_c, is accepted with probability min(1, p(x) / q_c(x)); on rejection
p <- normalize(max(p - q_c, 0)) and the next sibling is tried. An accepted child becomes the current
node and p becomes its own target row (its residual history is dropped). When every child of the
current node is rejected (or it has none) the bonus is a sample of the current p.

q_c is the distribution child c was actually drawn from, given the tokens of its earlier siblings
(`child_draft_probs[c]`):
- children drawn i.i.d. from the drafter's q (SpecInfer): q_c = q for every sibling;
- drawn without replacement: q_c = q with the earlier siblings' tokens zeroed, renormalised;
- chosen deterministically (EAGLE top-k, argmax): q_c is the point mass on x, whatever the
  drafter's softmax said (`child_draft_probs=None` for the whole tree). Then acceptance has
  probability p(x) and rejection just removes x from p: normalize(max(p - onehot(x), 0)) is p with
  x zeroed, renormalised. Passing the drafter's softmax value as q for a top-k child is NOT lossless.
The point-mass rule is in fact lossless for drafts chosen in ANY way (it conditions on the drafted
token: p(x) * [y = x] + (1 - p(x)) * p(y) [y != x] / (1 - p(x)) = p(y)), sampled ones included; it
only accepts less often than min(1, p/q) with the true q. So None is the safe choice whenever the
exact proposal distribution is not at hand. To mix both kinds in one tree, pass a one-hot row
for every deterministic child. With the true q_c, which sampled children end up in the tree must
not depend on their own tokens (pruning sampled nodes by their score, as EAGLE-2 does for its
deterministic top-k nodes, biases them): in that case verify them as point masses.

Why the output is exactly the target's distribution. One step: x ~ q, accepted with probability
min(1, p(x)/q(x)). The probability that y is emitted by acceptance is q(y) * min(1, p(y)/q(y)) =
min(p(y), q(y)); the rejection probability is 1 - sum_x min(p(x), q(x)) = sum_x max(p(x) - q(x), 0)
= Z, and the residual puts max(p(y) - q(y), 0) / Z on y. So if whatever happens after a rejection
emits a sample of the residual, y comes out with min(p, q)(y) + max(p - q, 0)(y) = p(y). After the
last sibling, the residual is sampled directly; before it, the next sibling faces the residual as
its "p" and, by induction from the last sibling backwards, emits exactly that residual. The
induction needs each q_c to be the law of x_c given everything the procedure has conditioned on
(earlier siblings' tokens and their rejections); rejections depend only on independent coins and
on those tokens, so q_c = law(x_c | earlier siblings' tokens) is right, and the residual after
rejecting c depends on q_c, not on x_c itself. For the point mass, q_c(x) = 1 and the same algebra
holds. Once a child with token y is accepted, the next token faces the target's conditional row
for prefix+y and the grandchildren were drafted given that prefix (before any coin was thrown), so
the same argument repeats level by level and the emitted sequence is a sample of the target,
token by token (chain rule). The chain is the tree with one child per node.

What breaks losslessness (the tests check these fail): accepting without the ratio test, sampling
the correction from p instead of the residual, using a q that is not the law the draft was drawn
from (the softmax value for a top-k child; plain q for siblings drawn without replacement), and
choosing which drafts to verify by looking at the drafted token itself (see
`specrt.runtime.scheduler` on the early stop).

Randomness: `generator` is a torch.Generator (or None for torch's global one). Any object with the
`Coins` methods (`accept(prob) -> bool`, `draw(probs) -> int`) is accepted in its place: the tests
use one that enumerates every random branch to compute exact output distributions.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from specrt.runtime.tree import children_lists

__all__ = [
    "Coins",
    "TorchCoins",
    "chain_parents",
    "verify_chain_greedy",
    "verify_chain_sampling",
    "verify_tree_greedy",
    "verify_tree_sampling",
]


@runtime_checkable
class Coins(Protocol):
    """The two random decisions verification makes."""

    def accept(self, prob: float) -> bool:
        """True with probability `prob` (in [0, 1])."""
        ...

    def draw(self, probs: torch.Tensor) -> int:
        """A sample of the (normalised, non-negative) distribution probs [V]."""
        ...


class TorchCoins:
    """Coins from a torch.Generator (None = torch's global generator)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def accept(self, prob: float) -> bool:
        # u in [0, 1): prob >= 1 always accepts, prob 0 never; one uniform per decision either way
        u = torch.rand((), generator=self.generator, device=self._device(), dtype=torch.float64).item()
        return u < prob

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs.to(self._device()), 1, generator=self.generator).item())

    def _device(self) -> torch.device:
        return self.generator.device if self.generator is not None else torch.device("cpu")


def _coins(generator: torch.Generator | Coins | None) -> Coins:
    if generator is None or isinstance(generator, torch.Generator):
        return TorchCoins(generator)
    if isinstance(generator, Coins):
        return generator
    raise TypeError(f"generator must be a torch.Generator, a Coins object or None, got {type(generator).__name__}")


def chain_parents(k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Tree format of a chain of k drafts: parents = [-1, 0, 1, ..., k-2]."""
    return torch.arange(-1, k - 1, dtype=torch.long, device=device)


def _accept_prob(p_x: float, q_x: float) -> float:
    """min(1, p/q); q = 0 (cannot have been drawn) accepts iff p > 0."""
    if p_x <= 0.0:
        return 0.0
    if q_x <= p_x:
        return 1.0
    return p_x / q_x


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)); p itself if that is all zero (p == q up to rounding)."""
    r = (p - q).clamp_min_(0.0)
    total = r.sum()
    if total.item() <= 0.0:
        return p
    return r / total


def _point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


def _gather(probs: torch.Tensor, tokens: torch.Tensor) -> list[float]:
    """[probs[i, tokens[i]] for i] as Python floats (one device sync)."""
    tok = tokens.to(probs.device).long().unsqueeze(-1)
    return probs.gather(-1, tok).squeeze(-1).double().tolist()


def row_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first of equal maxima (torch and numpy agree on that, and on NaN).
    On the CPU through numpy: torch's one-thread argmax along a 49152-wide row costs ~175 us to
    numpy's ~20 us, on every greedy step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    if t.dim() != 2 or t.shape[0] != rows:
        raise ValueError(f"{name} must be [{rows}, V], got shape {tuple(t.shape)}")


# --------------------------------------------------------------------------------------------- chain


def verify_chain_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """(n_accepted, bonus): longest prefix of drafts equal to the target's argmax, and the argmax after it.

    draft_tokens [k]; target_logits [k+1, V] (row i = after the anchor and the first i drafts).
    """
    k = int(draft_tokens.shape[0])
    _check_rows("target_logits", target_logits, k + 1)
    best = row_argmax(target_logits)
    drafts = draft_tokens.tolist()
    n = 0
    while n < k and drafts[n] == best[n]:
        n += 1
    return n, int(best[n])


def verify_chain_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | Coins | None = None,
) -> tuple[int, int]:
    """(n_accepted, token emitted after them): speculative sampling of a chain (module docstring).

    draft_tokens [k]; draft_probs [k, V] = the distributions the drafts were sampled from, over the
    target vocabulary (None: deterministic drafts, point masses); target_probs [k+1, V] =
    `probabilities(target_logits, params)`. The emitted token is the correction sample at the
    first rejection, or the bonus sample from target_probs[k] when all drafts pass.
    """
    k = int(draft_tokens.shape[0])
    _check_rows("target_probs", target_probs, k + 1)
    if draft_probs is not None:
        _check_rows("draft_probs", draft_probs, k)
    coins = _coins(generator)
    drafts = draft_tokens.tolist()
    p_x = _gather(target_probs[:k], draft_tokens)
    q_x = _gather(draft_probs, draft_tokens) if draft_probs is not None else [1.0] * k
    for i in range(k):
        if coins.accept(_accept_prob(p_x[i], q_x[i])):
            continue
        p = target_probs[i].double()
        q = draft_probs[i].double().to(p.device) if draft_probs is not None else _point_mass(drafts[i], p)
        return i, coins.draw(_residual(p, q))
    return k, coins.draw(target_probs[k].double())


# ---------------------------------------------------------------------------------------------- tree


def verify_tree_greedy(
    tokens: torch.Tensor, parents: torch.Tensor | Sequence[int], target_logits: torch.Tensor
) -> tuple[list[int], int]:
    """(path, bonus): the accepted root-to-node path (node indices, root excluded) and the bonus token.

    tokens [N], parents [N] (-1 = child of the root, parents before children), target_logits [N+1, V]
    (row 0 = root, row i+1 = node i).
    """
    n = int(tokens.shape[0])
    _check_rows("target_logits", target_logits, n + 1)
    children = children_lists(parents)
    best = row_argmax(target_logits)
    toks = tokens.tolist()
    path: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        nxt = next((c for c in children[node + 1] if toks[c] == want), None)
        if nxt is None:
            return path, int(want)
        path.append(nxt)
        node = nxt


def verify_tree_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor | Sequence[int],
    target_probs: torch.Tensor,
    child_draft_probs: torch.Tensor | None,
    generator: torch.Generator | Coins | None = None,
) -> tuple[list[int], int]:
    """(path, bonus): recursive multi-candidate rejection sampling over the tree (module docstring).

    target_probs [N+1, V] = `probabilities(target_logits, params)` (row 0 = root, row i+1 = node i);
    child_draft_probs [N, V]: row c = the distribution node c was drawn from given its earlier
    siblings (target vocabulary), or None when every child was chosen deterministically (top-k /
    argmax: point masses). `bonus` is the token emitted after the path (a residual sample when the
    last node's children were all rejected, else a sample of its target row).
    """
    n = int(tokens.shape[0])
    _check_rows("target_probs", target_probs, n + 1)
    if child_draft_probs is not None:
        _check_rows("child_draft_probs", child_draft_probs, n)
    coins = _coins(generator)
    children = children_lists(parents)
    toks = tokens.tolist()
    path: list[int] = []
    node = -1
    p = target_probs[0].double()
    while True:
        accepted = None
        for c in children[node + 1]:
            x = toks[c]
            q = child_draft_probs[c].double().to(p.device) if child_draft_probs is not None else None
            q_x = float(q[x]) if q is not None else 1.0
            if coins.accept(_accept_prob(float(p[x]), q_x)):
                accepted = c
                break
            p = _residual(p, q if q is not None else _point_mass(x, p))
        if accepted is None:
            return path, coins.draw(p)
        path.append(accepted)
        node = accepted
        p = target_probs[node + 1].double()
