"""The measured gate: scheduled serving runs plain steps wherever speculative steps measured slower."""

from __future__ import annotations

import pytest
from specrt.runtime.backends.torch_backend import TorchTargetEngine
from specrt.runtime.generate import generate_autoregressive
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import SpsTable
from specrt.runtime.serving.batcher import Batcher, Request
from specrt.runtime.serving.measured_gate import MeasuredGate
from test_serving_policy import SlowProposer
from test_speculative import block, tiny_target

pytestmark = pytest.mark.timeout(120)


def drive(gate: MeasuredGate, steps: int, rows: int, spec_rate: float, plain_rate: float) -> list[bool]:
    """`steps` steps where a speculative step yields spec_rate tokens/s and a plain one plain_rate."""
    choices = []
    for _ in range(steps):
        spec = gate.speculate(rows)
        choices.append(spec)
        rate = spec_rate if spec else plain_rate
        gate.record(rows, spec, tokens=rows * (2 if spec else 1), seconds=rows * (2 if spec else 1) / rate)
    return choices


def test_the_slower_kind_is_probed_ever_more_rarely():
    gate = MeasuredGate(warmup=3, first_probe=4, max_probe=16)
    choices = drive(gate, 200, rows=2, spec_rate=50.0, plain_rate=100.0)
    assert choices[:6] == [True] * 3 + [False] * 3  # warm-up: each kind measured
    later = choices[100:]
    assert 0 < sum(later) <= len(later) / 16 + 1  # speculation probed, at the longest back-off
    assert gate.arms[2].probe_every == 16


def test_when_speculation_wins_plain_steps_are_the_probes():
    gate = MeasuredGate(warmup=2, first_probe=4, max_probe=8)
    choices = drive(gate, 100, rows=1, spec_rate=150.0, plain_rate=100.0)
    later = choices[50:]
    assert 0 < later.count(False) <= len(later) / 8 + 1


def test_each_row_count_is_judged_apart_and_a_flip_resets_the_back_off():
    gate = MeasuredGate(warmup=2, first_probe=4, max_probe=32)
    drive(gate, 60, rows=1, spec_rate=200.0, plain_rate=100.0)
    drive(gate, 60, rows=4, spec_rate=50.0, plain_rate=100.0)
    summary = gate.summary()
    assert summary[1]["speculative_tok_s"] > summary[1]["plain_tok_s"]
    assert summary[4]["speculative_tok_s"] < summary[4]["plain_tok_s"]
    assert gate.arms[4].probe_every == 32
    # the load changes: speculation at 4 rows now pays; the decayed sums follow and probing speeds up
    after = drive(gate, 400, rows=4, spec_rate=300.0, plain_rate=100.0)
    assert sum(after[-50:]) >= 50 - 50 / 4 and gate.arms[4].spec_leads


def test_bad_settings_are_refused():
    for kwargs in ({"warmup": 0}, {"decay": 1.0}, {"first_probe": 1}, {"first_probe": 8, "max_probe": 4}):
        with pytest.raises(ValueError):
            MeasuredGate(**kwargs)


def test_a_drafter_that_measures_slower_is_left_out_losslessly():
    """Predictions say drafting pays (a flat SPS table, draft gate off), but each draft costs 20 ms:
    the measured gate runs nearly every step plain, and outputs equal each request alone."""
    target = tiny_target()
    prompts = [[5, 9, 13, 2], [11, 3]]
    alone = [generate_autoregressive(TorchTargetEngine(target, 128), [p], 40, SamplingParams()).tokens[0]
             for p in prompts]
    flat = SpsTable([1, 1024], [1000.0, 999.0])
    proposer = SlowProposer(block(target, "dspark"), 0.02)
    batcher = Batcher(TorchTargetEngine(target, 128, 2), proposer, "confidence", flat, draft_gate=False)
    requests = [batcher.add(Request(p, 40)) for p in prompts]
    batcher.run_until_done()
    assert [r.tokens for r in requests] == alone
    c = batcher.counters
    assert c.measured_plain_steps >= c.steps - c.draft_steps and c.draft_steps <= 3 + c.steps / 8 + 1
    unmeasured = Batcher(TorchTargetEngine(target, 128, 2), proposer, "confidence", flat, draft_gate=False,
                         measured_gate=False)
    requests = [unmeasured.add(Request(p, 40)) for p in prompts]
    unmeasured.run_until_done()
    assert [r.tokens for r in requests] == alone and unmeasured.counters.draft_steps == unmeasured.counters.steps
