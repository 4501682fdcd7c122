"""DSpark's confidence scheduler (Algorithm 1): hand-checked schedules, the early stop, the SPS table,
and why a global search instead of the early stop is lossy."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
import torch

from specrt.plugins.errors import SpecrtError
from specrt.runtime.scheduler import Schedule, SpsTable, schedule, survival
from specrt.runtime.verify import verify_chain_sampling


def test_algorithm_1_hand_computed():
    # R = 2: start tau = 2, B = 2, Theta = 2 * SPS(2) = 200
    # sorted candidates (a, j, r): (.9,1,0) (.72,2,0) (.6,1,1) (.36,3,0) (.3,2,1)
    #   + (.9,1,0):  tau 2.90, B 3: 2.90 * 95 = 275.5  > 200    admit
    #   + (.72,2,0): tau 3.62, B 4: 3.62 * 88 = 318.56 > 275.5  admit
    #   + (.6,1,1):  tau 4.22, B 5: 4.22 * 80 = 337.6  > 318.56 admit
    #   + (.36,3,0): tau 4.58, B 6: 4.58 * 70 = 320.6  <= 337.6 STOP
    sps = SpsTable([1, 2, 3, 4, 5, 6, 7, 8], [110, 100, 95, 88, 80, 70, 60, 50])
    a0 = survival([0.9, 0.8, 0.5])
    assert a0 == pytest.approx([0.9, 0.72, 0.36])
    s = schedule([a0, [0.6, 0.3]], sps)
    assert s.lengths == [2, 1]
    assert s.tokens == 5
    assert s.tau == pytest.approx(4.22)
    assert s.throughput == pytest.approx(337.6)
    assert s.baseline == pytest.approx(200.0)


def test_ties_go_to_the_earlier_draft_then_the_lower_request():
    sps = SpsTable([2, 3, 4], [100.0, 90.0, 70.0])
    # all .5: order (r0,j1) (r1,j1) then j2s; + (r0,1): 2.5*90 = 225 > 200; + (r1,1): 3.0*70 = 210 stop
    s = schedule([[0.5, 0.5], [0.5, 0.5]], sps)
    assert s.lengths == [1, 0] and s.tokens == 3


def test_early_stop_is_the_first_non_improving_candidate():
    # R = 1. SPS has a dip at B = 2 and recovers a little at B = 3 (e.g. a slow path for 2 rows).
    # Theta: B=1: 1 * 100 = 100; + a1: 1.5 * 60 = 90 (no improvement: STOP); + a2 would give
    # 1.95 * 58 = 113.1 > 100, but the early stop never looks at it.
    sps = SpsTable([1, 2, 3], [100.0, 60.0, 58.0])
    s = schedule([[0.5, 0.45]], sps)
    assert s.lengths == [0] and s.tokens == 1 and s.throughput == pytest.approx(100.0)
    assert _global_search([[0.5, 0.45]], sps).lengths == [2]  # the look-ahead rule verifies both


def test_flat_sps_admits_every_positive_candidate_and_zero_survival_never():
    s = schedule([[0.9, 0.5, 0.0], [0.2], []], lambda b: 50.0 if b <= 10 else 1.0)
    assert s.lengths == [2, 1, 0] and s.tokens == 6 and s.tau == pytest.approx(4.6)
    # even when SPS rises with B (a noisy profile), a token with a = 0 is never admitted
    s = schedule([[0.0, 0.0]], lambda b: float(b))
    assert s.lengths == [0]


def test_max_tokens_caps_the_verify_batch():
    sps = SpsTable([1, 2, 3, 4], [100.0, 100.0, 100.0, 100.0])
    assert schedule([[0.9, 0.9, 0.9, 0.9]], sps).lengths == [3]  # the table's largest size
    assert schedule([[0.9, 0.9, 0.9, 0.9]], sps, max_tokens=2).lengths == [1]
    with pytest.raises(SpecrtError):
        schedule([[0.5]] * 5, sps)  # 5 anchors do not fit a table measured up to 4 tokens
    assert schedule([], sps) == Schedule(lengths=[], tau=0.0, tokens=0, throughput=0.0, baseline=0.0)


def test_bad_survivals_are_rejected():
    with pytest.raises(ValueError):
        schedule([[0.5, 0.7]], lambda b: 1.0)
    with pytest.raises(ValueError):
        schedule([[1.5]], lambda b: 1.0)
    with pytest.raises(ValueError):
        survival([0.5, -0.1])


def test_random_schedules_satisfy_the_algorithm():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n_req = int(torch.randint(1, 6, (1,), generator=g))
        rows = [survival(torch.rand(int(torch.randint(0, 8, (1,), generator=g)), generator=g).tolist())
                for _ in range(n_req)]
        slope = float(torch.rand((), generator=g)) * 0.3
        bumps = (torch.rand(60, generator=g) * 0.2).tolist()
        sps = SpsTable(list(range(1, 61)), [1000.0 / (1 + slope * b) * (1 - bumps[b - 1]) for b in range(1, 61)])
        s = schedule(rows, sps)
        # prefixes, counts and the reported objective
        assert all(0 <= l <= len(row) for l, row in zip(s.lengths, rows))
        assert s.tokens == n_req + sum(s.lengths)
        assert s.tau == pytest.approx(n_req + sum(sum(row[:l]) for l, row in zip(s.lengths, rows)))
        assert s.throughput == pytest.approx(s.tau * sps(s.tokens)) and s.throughput >= s.baseline
        # replay: every admitted candidate improved Theta, and the next one (if any) does not
        order = sorted(((a, j, r) for r, row in enumerate(rows) for j, a in enumerate(row, 1) if a > 0),
                       key=lambda c: (-c[0], c[1], c[2]))
        taken = sum(s.lengths)
        tau, b, best = float(n_req), n_req, n_req * sps(n_req)
        for a, j, r in order[:taken]:
            assert j <= s.lengths[r]
            theta = (tau + a) * sps(b + 1)
            assert theta > best
            tau, b, best = tau + a, b + 1, theta
        if taken < len(order) and b + 1 <= sps.max_tokens:
            assert (tau + order[taken][0]) * sps(b + 1) <= best


# ---------------------------------------------------------------------------------------- SPS table


def test_sps_table_interpolates_step_time_and_refuses_unmeasured_sizes():
    t = SpsTable([1, 4, 8], [100.0, 80.0, 40.0])
    assert t(1) == 100.0 and t(4) == 80.0 and t(8) == 40.0
    # step times 12.5 ms (B=4) and 25 ms (B=8): at B=6 the time is 18.75 ms
    assert t(6) == pytest.approx(1000.0 / 18.75)
    assert t(2) == pytest.approx(1.0 / (0.01 + (0.0125 - 0.01) / 3))
    for b in (0, 9):
        with pytest.raises(SpecrtError) as err:
            t(b)
        assert err.value.fix
    assert (t.min_tokens, t.max_tokens) == (1, 8)


def test_sps_table_save_load_roundtrip(tmp_path):
    t = SpsTable([1, 2, 16], [120.5, 118.0, 61.25], meta={"device": "cpu", "engine": "torch"})
    path = tmp_path / "sps.json"
    t.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "specrt.sps" and data["version"] == 1
    back = SpsTable.load(path)
    assert back.tokens == t.tokens and back.steps_per_second == t.steps_per_second and back.meta == t.meta
    assert back(9) == pytest.approx(t(9))


@pytest.mark.parametrize("content", [
    "not json {",
    json.dumps([1, 2]),
    json.dumps({"format": "other", "version": 1, "tokens": [1], "steps_per_second": [1.0]}),
    json.dumps({"format": "specrt.sps", "version": 99, "tokens": [1], "steps_per_second": [1.0]}),
    json.dumps({"format": "specrt.sps", "version": 1, "tokens": [1, 2], "steps_per_second": [1.0]}),
    json.dumps({"format": "specrt.sps", "version": 1, "tokens": [], "steps_per_second": []}),
    json.dumps({"format": "specrt.sps", "version": 1, "tokens": [2, 1], "steps_per_second": [1.0, 2.0]}),
    json.dumps({"format": "specrt.sps", "version": 1, "tokens": [1, 1], "steps_per_second": [1.0, 2.0]}),
    json.dumps({"format": "specrt.sps", "version": 1, "tokens": [0, 1], "steps_per_second": [1.0, 2.0]}),
    json.dumps({"format": "specrt.sps", "version": 1, "tokens": [1.5], "steps_per_second": [1.0]}),
    json.dumps({"format": "specrt.sps", "version": 1, "tokens": [1], "steps_per_second": [0.0]}),
    json.dumps({"format": "specrt.sps", "version": 1, "tokens": [1], "steps_per_second": ["fast"]}),
    json.dumps({"format": "specrt.sps", "version": 1, "tokens": "1,2", "steps_per_second": [1.0]}),
    '{"format": "specrt.sps", "version": 1, "tokens": [1], "steps_per_second": [NaN]}',
])
def test_bad_sps_tables_raise_specrt_errors(tmp_path, content):
    path = tmp_path / "sps.json"
    path.write_text(content)
    with pytest.raises(SpecrtError) as err:
        SpsTable.load(path)
    assert str(path) in err.value.problem and err.value.fix


def test_missing_sps_table(tmp_path):
    with pytest.raises(SpecrtError) as err:
        SpsTable.load(tmp_path / "nope.json")
    assert "does not exist" in err.value.problem and err.value.fix


# ------------------------------------------------------------- why the early stop keeps it lossless
#
# "Lossy" in the paper's sense (DSpark, Algorithm 1 and Appendix A): the scheduler would change the
# distribution of the generated text. Speculative sampling is exact only if the decision to verify
# draft x_j is made without looking at x_j (x_j must still be a sample of q_j when it is tested).
# DSpark's confidence for position j+1 is computed from the previous token x_j
# (c_{j+1} = sigmoid(w . [h_{j+1}; W1[x_j]])), so a_{j+1} carries information about x_j. The early
# stop decides on (r, j) before it ever looks at a_{r,j+1}: lossless. A global search that scans all
# prefixes of the sorted list and keeps the best Theta does look at a_{r,j+1}: below it verifies x_1
# only when x_1 is the token the confidence head likes, and the first emitted token is biased.

SPS_DIP = SpsTable([1, 2, 3], [100.0, 60.0, 58.0])
P1 = torch.tensor([0.5, 0.5], dtype=torch.float64)  # target distribution of the first token
Q1 = torch.tensor([0.8, 0.2], dtype=torch.float64)  # drafter's distribution of the first draft
C1 = 0.5  # confidence of draft 1 (depends only on the anchor)
C2 = {0: 0.9, 1: 0.1}  # confidence of draft 2, from the Markov embedding of x_1


def P2(x1):  # target distribution of the second token, given the first
    return torch.tensor([0.3, 0.7] if x1 == 0 else [0.6, 0.4], dtype=torch.float64)


def Q2(x1):  # drafter's distribution of the second draft
    return torch.tensor([0.5, 0.5], dtype=torch.float64)


def _global_search(survivals, sps) -> Schedule:
    """The WRONG rule: walk the whole sorted list and keep the prefix with the best Theta."""
    n_req = len(survivals)
    order = sorted(((a, j, r) for r, row in enumerate(survivals) for j, a in enumerate(row, 1) if a > 0),
                   key=lambda c: (-c[0], c[1], c[2]))
    tau, b = float(n_req), n_req
    best, best_n, best_tau = tau * sps(b), 0, tau
    for n, (a, j, r) in enumerate(order, 1):
        if b + 1 > sps.max_tokens:
            break
        tau, b = tau + a, b + 1
        if tau * sps(b) > best:
            best, best_n, best_tau = tau * sps(b), n, tau
    lengths = [0] * n_req
    for a, j, r in order[:best_n]:
        lengths[r] = max(lengths[r], j)
    return Schedule(lengths, best_tau, n_req + best_n, best, n_req * sps(n_req))


class _Enumerate:
    """Coins that enumerate every random branch of one verify call (see tests/test_verify.py)."""

    def __init__(self, script):
        self.script, self.pos, self.prob, self.pending = list(script), 0, 1.0, []

    def _choose(self, options):
        options = [(v, w) for v, w in options if w > 0]
        if self.pos >= len(self.script):
            self.pending += [self.script[: self.pos] + [alt] for alt in range(1, len(options))]
            self.script = self.script[: self.pos] + [0]
        value, weight = options[self.script[self.pos]]
        self.pos += 1
        self.prob *= weight
        return value

    def accept(self, prob):
        return self._choose([(True, prob), (False, 1 - prob)])

    def draw(self, probs):
        probs = probs.double() / probs.sum()
        return self._choose(list(enumerate(probs.tolist())))


def _exact_first_two_tokens(rule, sampled: bool) -> dict:
    """Exact law of the first two output tokens: draft 2 tokens, schedule, verify, then target."""
    out: dict = defaultdict(float)
    x1_law = Q1 if sampled else torch.nn.functional.one_hot(Q1.argmax(), 2).double()
    for x1 in (0, 1):
        for x2 in (0, 1):
            x2_law = Q2(x1) if sampled else torch.nn.functional.one_hot(Q2(x1).argmax(), 2).double()
            w = float(x1_law[x1] * x2_law[x2])
            if w == 0:
                continue
            a = survival([C1, C2[x1]])
            length = rule([a], SPS_DIP).lengths[0]
            drafts = torch.tensor([x1, x2][:length])
            q = torch.stack([Q1, Q2(x1)])[:length] if sampled else None
            target = torch.stack([P1, P2(x1), torch.tensor([0.5, 0.5], dtype=torch.float64)])[: length + 1]
            stack = [[]]
            while stack:
                coins = _Enumerate(stack.pop())
                n_acc, tok = verify_chain_sampling(drafts, q, target, coins)
                stack += coins.pending
                emitted = [x1, x2][:n_acc] + [tok]
                if len(emitted) == 1:  # complete with the target
                    for y, py in enumerate(P2(emitted[0]).tolist()):
                        out[(emitted[0], y)] += w * coins.prob * py
                else:
                    out[tuple(emitted[:2])] += w * coins.prob
    return out


def _target_first_two() -> dict:
    return {(a, b): float(P1[a] * P2(a)[b]) for a in (0, 1) for b in (0, 1)}


def test_global_search_is_lossy_and_the_early_stop_is_not():
    # For x1 = 0: a = [.5, .45]; early stop: 1.5 * 60 = 90 <= 100 -> verify nothing;
    #   global search: 1.95 * 58 = 113.1 > 100 -> verify both drafts.
    # For x1 = 1: a = [.5, .05]; both rules verify nothing (1.55 * 58 = 89.9).
    assert schedule([survival([C1, C2[0]])], SPS_DIP).lengths == [0]
    assert _global_search([survival([C1, C2[0]])], SPS_DIP).lengths == [2]
    assert _global_search([survival([C1, C2[1]])], SPS_DIP).lengths == [0]
    # The global rule verifies x1 only when x1 = 0, a token the drafter over-proposes (.8 vs .5):
    # P(first = 0) = .8 * min(1, .5/.8) + .2 * .5 = .6 instead of .5.
    target = _target_first_two()
    lossless = _exact_first_two_tokens(schedule, sampled=True)
    lossy = _exact_first_two_tokens(_global_search, sampled=True)
    assert max(abs(lossless[k] - target[k]) for k in target) < 1e-12
    assert lossy[(0, 0)] + lossy[(0, 1)] == pytest.approx(0.6)
    assert max(abs(lossy[k] - target[k]) for k in target) > 0.05


def test_with_deterministic_drafts_either_rule_is_lossless():
    """Greedy drafts carry no randomness to condition on, so the look-ahead cannot bias them."""
    target = _target_first_two()
    for rule in (schedule, _global_search):
        dist = _exact_first_two_tokens(rule, sampled=False)
        assert max(abs(dist[k] - target[k]) for k in target) < 1e-12


def test_throughput_rises_monotonically_under_the_early_stop():
    # the global rule's schedule passes through Theta = 90 < 100 (plain decoding) on its way to 113.1;
    # the early stop never admits a token that lowers the expected throughput when it is considered
    s = schedule([[0.5, 0.45]], SPS_DIP)
    assert s.throughput == s.baseline == 100.0
    assert math.isclose(_global_search([[0.5, 0.45]], SPS_DIP).throughput, 113.1)
