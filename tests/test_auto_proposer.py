"""`--drafter auto` (`specrt.runtime.proposers.auto`): the measured choice among plain steps, copies and
the drafter picks the arm that delivers the most tokens per second, never changes greedy output, keeps
sampling exact, and a named drafter that was slower than the automatic choice gets a note.

Step costs are injected: a fake clock advances by a verify cost (c0 + c1 per verified row) in the
target's forward and by a drafting cost in the drafter arm, so the choices are deterministic."""

from __future__ import annotations

import pytest
import torch
from specrt.runtime.backends.torch_backend import TorchTargetEngine
from specrt.runtime.proposers.auto import COPIES, DRAFTER, PLAIN, AutoProposer
from specrt.runtime.proposers.lookup import LookupProposer, WithLookup
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import generate_speculative
from test_lookup import LOOPY
from test_speculative import (
    PROMPTS,
    block,
    chi_square_pvalue,
    eagle3,
    exact_first_tokens,
    plain,
    sampled,
    small_target,  # noqa: F401  (a fixture)
    tiny_target,
)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostedEngine(TorchTargetEngine):
    """A torch engine whose forward advances the fake clock by c0 + c1 * verified rows."""

    def __init__(self, model, capacity, batch, clock: FakeClock, c0: float = 0.008, c1: float = 0.002):
        super().__init__(model, capacity, batch)
        self.clock, self.c0, self.c1 = clock, c0, c1

    def forward(self, ids, positions, new_mask, logits_rows=None):
        self.clock.now += self.c0 + self.c1 * int(ids.shape[0] * ids.shape[1])
        return super().forward(ids, positions, new_mask, logits_rows)


class Scripted:
    """Drafts n tokens per row from a known continuation: right (they all land) or shifted by one
    (none lands). Test-only: it reads the plain output to know what the target will say."""

    tap_layers = ()

    def __init__(self, truth: list[list[int]], right: bool, n: int = 4, clock: FakeClock | None = None,
                 cost: float = 0.0, name: str = "scripted") -> None:
        self.truth, self.right, self.n, self.clock, self.cost, self.name = truth, right, n, clock, cost, name
        self.max_drafts = n

    def reset(self, batch_size, capacity):
        self.lengths = [0] * batch_size
        self.anchor_index = [-1] * batch_size

    def context_length(self, row):
        return self.lengths[row]

    def observe(self, rows, tokens, taps, next_tokens):
        for b, toks in zip(rows, tokens):
            # the prompt sets the anchor at output index 0; each round moves it by anchor + accepted
            self.anchor_index[b] = 0 if self.anchor_index[b] < 0 else self.anchor_index[b] + len(toks)
            self.lengths[b] += len(toks)

    def propose(self, rows, anchors, sampling, generator):
        from specrt.runtime.proposers.base import Proposal

        if self.clock is not None:
            self.clock.now += self.cost
        out = []
        for b in rows:
            i = self.anchor_index[b] + 1
            want = self.truth[b][i:i + self.n] or [0]
            out.append(Proposal.chain(torch.tensor([t if self.right else (t + 1) % 61 for t in want])))
        return out


def _counting(proposer: AutoProposer, sequence: list[str] | None = None) -> dict[str, int]:
    """Wrap proposer._choose and proposer.plain_run to count the rounds each arm runs (and list them in
    `sequence`; a plain run of n rounds as n plain rounds)."""
    counts = {PLAIN: 0, COPIES: 0, DRAFTER: 0}
    choose, plain_run = proposer._choose, proposer.plain_run

    def counted(sampling):
        arm = choose(sampling)
        counts[arm] += 1
        if sequence is not None:
            sequence.append(arm)
        return arm

    def counted_run(sampling):
        rounds = plain_run(sampling)
        counts[PLAIN] += rounds
        if sequence is not None:
            sequence.extend([PLAIN] * rounds)
        return rounds

    proposer._choose, proposer.plain_run = counted, counted_run
    return counts


def _after_warmup(arms: list[str], leader: str, warmup_rounds: int = 6) -> None:
    """After the warm-up every round is the leader's but the probes (at most one in 8 rounds)."""
    rest = arms[warmup_rounds:]
    assert rest and rest.count(leader) >= len(rest) - (len(rest) + 7) // 8, arms


def _run(target, proposer, prompts, n, clock, sampling=None):
    engine = CostedEngine(target, 256, len(prompts), clock)
    return generate_speculative(engine, proposer, prompts, n, sampling or SamplingParams())


def test_auto_picks_plain_when_drafts_never_land(target):
    truth = plain(target, PROMPTS, 48)
    clock = FakeClock()
    auto = AutoProposer(Scripted(truth, right=False), Scripted(truth, right=False, clock=clock, cost=0.004),
                        clock=clock)
    arms: list[str] = []
    _counting(auto, arms)
    result = _run(target, auto, PROMPTS, 48, clock)
    assert result.tokens == truth
    _after_warmup(arms, PLAIN)
    summary = auto.summary()
    assert summary["plain"]["tok_s"] > max(v["tok_s"] for k, v in summary.items() if k != "plain")


def test_auto_picks_copies_when_they_land(target):
    truth = plain(target, PROMPTS, 48)
    clock = FakeClock()
    auto = AutoProposer(Scripted(truth, right=True), Scripted(truth, right=False, clock=clock, cost=0.004),
                        clock=clock)
    arms: list[str] = []
    _counting(auto, arms)
    result = _run(target, auto, PROMPTS, 48, clock)
    assert result.tokens == truth
    _after_warmup(arms, COPIES)


def test_auto_picks_a_drafter_that_pays_for_itself(target):
    truth = plain(target, PROMPTS, 48)
    clock = FakeClock()
    auto = AutoProposer(Scripted(truth, right=False, n=2), Scripted(truth, right=True, n=6, clock=clock, cost=0.003),
                        clock=clock)
    arms: list[str] = []
    _counting(auto, arms)
    assert _run(target, auto, PROMPTS, 48, clock).tokens == truth
    _after_warmup(arms, DRAFTER)


def test_the_leader_changes_when_the_text_does(target):
    """Copies land for the first half of the request, then stop: auto moves to plain steps."""
    truth = plain(target, [PROMPTS[0]], 90)
    clock = FakeClock()
    copies = Scripted(truth, right=True)
    auto = AutoProposer(copies, clock=clock)
    arms = []
    choose = auto._choose

    def spy(sampling):
        arm = choose(sampling)
        arms.append(arm)
        copies.right = copies.anchor_index[0] < 40
        return arm

    auto._choose = spy
    assert _run(target, auto, [PROMPTS[0]], 90, clock).tokens == truth
    late = arms[-20:]
    assert late.count(PLAIN) >= 15, arms
    assert arms[6:16].count(COPIES) >= 8, arms


MAKERS = {"eagle3": lambda t: eagle3(t), "dflash": lambda t: block(t, "dflash"), "dspark": lambda t: block(t, "dspark")}


@pytest.mark.parametrize("kind,batched", [("eagle3", False), ("eagle3", True), ("dflash", True), ("dspark", False)])
def test_greedy_auto_with_real_arms_equals_plain_decoding(target, kind, batched):
    """Whatever the clock says (here: a jittery one that makes the arms change often), the output is
    plain decoding's, and the drafter that sat out rounds drafts from the right context afterwards."""
    ticks = iter(range(10**6))

    def jitter() -> float:  # deterministic, uneven: arms keep overtaking each other
        return (next(ticks) * 7919 % 104729) / 1000.0

    auto = AutoProposer(LookupProposer(max_tokens=6), WithLookup(MAKERS[kind](target), max_tokens=6), warmup=1,
                        first_probe=2, max_probe=4, clock=jitter)
    counts = _counting(auto)
    for prompts in (PROMPTS, LOOPY):
        expected = plain(target, prompts, 30)
        if batched:
            got = generate_speculative(TorchTargetEngine(target, 128, len(prompts)), auto, prompts, 30,
                                       SamplingParams()).tokens
        else:
            got = []
            for p in prompts:
                got.append(generate_speculative(TorchTargetEngine(target, 128), auto, [p], 30,
                                                SamplingParams()).tokens[0])
                # the drafter's context, once caught up, is every committed token: the copies' count
                auto.backlog.catch_up()
                assert auto.inner.lengths[0] == auto.copies.lengths[0] > len(p)
        assert got == expected
    assert min(counts.values()) > 0, counts


def test_sampling_with_auto_keeps_the_target_distribution(small_target):  # noqa: F811
    """Arms change between the rounds of each sampled request (warm-up of one round each: the drafter,
    the copies, plain); the first tokens keep the target's exact distribution."""
    params = SamplingParams(temperature=0.9, top_k=5, seed=1234)
    prompt = [1, 4, 1, 4, 1]
    auto = AutoProposer(LookupProposer(max_tokens=3, threshold=0.0),
                        WithLookup(block(small_target, "dflash", threshold=0.05), max_tokens=3, threshold=0.0),
                        warmup=1, fixed_when_seeded=False, clock=FakeClock())
    auto.arms = (DRAFTER, COPIES, PLAIN)  # the drafter first: one batched forward, no catch-up of 6000 rows
    counts = _counting(auto)
    exact = exact_first_tokens(small_target, prompt, params, 3)
    assert chi_square_pvalue(sampled(small_target, auto, prompt, params, 3), exact, 3) > 1e-3
    assert counts[COPIES] and counts[DRAFTER], counts


def test_a_request_whose_seed_drives_the_coins_runs_one_arm_and_repeats(target):
    """A seed's random stream ("stream" rule, or a rule nobody handed over) must be consumed the same
    way every run: no clock in its choices."""
    auto = AutoProposer(LookupProposer(max_tokens=4), WithLookup(eagle3(target), max_tokens=4))
    seeded = SamplingParams(temperature=0.8, seed=7)
    auto.reset(1, 64)
    assert {auto._choose(seeded) for _ in range(40)} == {DRAFTER}
    assert {AutoProposer(LookupProposer())._choose(seeded) for _ in range(5)} == {COPIES}
    assert AutoProposer(LookupProposer(), eagle3(target), pinned=COPIES)._choose(seeded) == COPIES
    counts = _counting(auto)
    runs = [generate_speculative(TorchTargetEngine(target, 128, 2), auto, LOOPY[:2], 30, seeded,
                                 seeded_sampling="stream").tokens for _ in range(2)]
    assert runs[0] == runs[1]
    assert counts[DRAFTER] and not counts[PLAIN] and not counts[COPIES], counts


def test_a_seeded_request_under_the_noise_rule_is_chosen_by_the_clock(target):
    """Under the default seeded rule the text depends on prompt, settings and seed alone, so the clock
    chooses as for greedy requests: drafts that never land lose to plain steps, and the text is plain
    decoding's with that seed."""
    seeded = SamplingParams(temperature=1.0, seed=11)
    truth = plain(target, PROMPTS, 48, seeded)
    clock = FakeClock()
    auto = AutoProposer(Scripted(truth, right=False), Scripted(truth, right=False, clock=clock, cost=0.004),
                        clock=clock)
    arms: list[str] = []
    _counting(auto, arms)
    assert _run(target, auto, PROMPTS, 48, clock, seeded).tokens == truth
    _after_warmup(arms, PLAIN)


def test_plain_rounds_of_a_sampled_request_run_in_one_go(target):
    """While plain leads a lone sampled request, the rounds up to the next probe run as plain steps in
    one go (`plain_run`): no propose between them, one ingest at the end, the probes still on
    schedule. The text is plain decoding's with that seed, and the copy index has every token."""
    seeded = SamplingParams(temperature=1.0, seed=5)
    truth = plain(target, PROMPTS[:1], 120, seeded)
    clock = FakeClock()
    copies = LookupProposer()
    auto = AutoProposer(copies, Scripted(truth, right=False, clock=clock, cost=0.004), clock=clock)
    runs: list[int] = []
    plain_run = auto.plain_run
    auto.plain_run = lambda sampling: runs.append(plain_run(sampling)) or runs[-1]
    arms: list[str] = []
    choose = auto._choose
    auto._choose = lambda sampling: arms.append(choose(sampling)) or arms[-1]
    result = _run(target, auto, PROMPTS[:1], 120, clock, seeded)
    assert result.tokens == truth
    long_runs = [n for n in runs if n]
    assert len(long_runs) >= 2 and max(long_runs) >= 7, runs
    assert sum(long_runs) > len(arms), (runs, arms)  # most rounds ran in runs, not one by one
    # the round after a run is a probe of another arm, as `_choose` alone would have made it
    assert arms.count(COPIES) + arms.count(DRAFTER) >= len(long_runs) - 1, arms
    # every round is a chosen one or one of a run (the last run ends with the request)
    assert len(arms) + sum(long_runs[:-1]) < result.stats[0].rounds <= len(arms) + sum(long_runs)
    # the copies saw every token of the rounds that went on: the prompt and the output but the
    # finishing round's token (a row that stops is not ingested, run or not)
    assert copies.lookup.index[0].tokens == list(PROMPTS[0]) + truth[0][:-1]
    assert auto.summary()["plain"]["rounds"] >= sum(long_runs[:-1])  # the last run is not closed yet


def test_greedy_and_batched_requests_choose_round_by_round(target):
    """A greedy plain round looks up the copies that pay, and a batch is chosen per step: no runs."""
    truth = plain(target, PROMPTS, 48)
    clock = FakeClock()
    auto = AutoProposer(LookupProposer(), Scripted(truth, right=False, clock=clock, cost=0.004), clock=clock)
    runs: list[int] = []
    plain_run = auto.plain_run
    auto.plain_run = lambda sampling: runs.append(plain_run(sampling)) or runs[-1]
    assert _run(target, auto, PROMPTS[:1], 48, clock).tokens == truth[:1]
    assert runs and not any(runs), runs
    seeded = SamplingParams(temperature=1.0, seed=5)
    runs.clear()
    _run(target, auto, PROMPTS, 48, clock, seeded)
    assert not any(runs)  # a batch of 3 (its last row alone included) goes round by round


def test_a_named_drafter_slower_than_the_automatic_choice_gets_a_note(target):
    truth = plain(target, PROMPTS[:1], 48)
    clock = FakeClock()
    slow = Scripted(truth, right=False, clock=clock, cost=0.01, name="slowdrafter")
    named = AutoProposer(Scripted(truth, right=True), slow, pinned=DRAFTER, clock=clock)
    assert named.name == "slowdrafter"
    counts = _counting(named)
    assert _run(target, named, PROMPTS[:1], 48, clock).tokens == truth
    assert counts[DRAFTER] and counts[PLAIN] and counts[COPIES], counts
    note = named.slower_note()
    assert note is not None and "slowdrafter" in note and "scripted" in note
    # a named drafter that is the fastest gets none
    fast = AutoProposer(Scripted(truth, right=False), Scripted(truth, right=True, n=6, clock=clock, cost=0.001),
                        pinned=DRAFTER, clock=clock)
    _run(target, fast, PROMPTS[:1], 48, clock)
    assert fast.slower_note() is None
    assert AutoProposer(Scripted(truth, right=True), slow, clock=clock).slower_note() is None  # auto: never


def test_a_named_drafter_slower_than_plain_rounds_goes_dormant(target):
    """A named drafter that measures slower than plain rounds lets the rounds run plain, keeps being
    probed, and takes over again when it pays: it is never the slow choice. Greedy output is plain's."""
    truth = plain(target, PROMPTS[:1], 90)
    clock = FakeClock()
    slow = Scripted(truth, right=False, clock=clock, cost=0.01, name="slowdrafter")
    named = AutoProposer(Scripted(truth, right=False), slow, pinned=DRAFTER, clock=clock)
    arms: list[str] = []
    _counting(named, arms)
    assert _run(target, named, PROMPTS[:1], 90, clock).tokens == truth
    first_plain = arms.index(PLAIN)  # the first plain probe: from then on plain leads
    rest = arms[first_plain + 1:]
    assert rest.count(PLAIN) > 0.75 * len(rest) and DRAFTER in rest, arms
    assert named.dormant
    # a named drafter that pays runs every round but the probes
    fast_arms: list[str] = []
    fast = AutoProposer(Scripted(truth, right=False), Scripted(truth, right=True, n=6, clock=clock, cost=0.001),
                        pinned=DRAFTER, clock=clock)
    _counting(fast, fast_arms)
    assert _run(target, fast, PROMPTS[:1], 90, clock).tokens == truth
    assert fast_arms.count(DRAFTER) > 0.75 * len(fast_arms) and not fast.dormant, fast_arms


def test_an_arm_whose_drafts_never_land_does_not_lead_plain_on_timing_alone(target):
    """Rounds whose drafts never land commit what plain rounds do, so they cannot really be faster: a
    timing that says they are (here the drafter's clock runs backwards, like noise on a busy machine)
    is bounded to a tie, which plain wins, for the automatic choice and for a named drafter alike."""
    truth = plain(target, PROMPTS[:1], 90)
    for pinned in (None, DRAFTER):
        clock = FakeClock()
        lucky = Scripted(truth, right=False, clock=clock, cost=-0.015, name="lucky")
        auto = AutoProposer(Scripted(truth, right=False), lucky, pinned=pinned, clock=clock)
        arms: list[str] = []
        _counting(auto, arms)
        assert _run(target, auto, PROMPTS[:1], 90, clock).tokens == truth
        assert auto.rates[DRAFTER].rate > auto.rates[PLAIN].rate  # the timing alone would pick the drafter
        assert auto.estimate(DRAFTER) <= auto.rates[PLAIN].rate
        rest = arms[arms.index(PLAIN) + 1:]
        assert rest.count(PLAIN) > 0.75 * len(rest), (pinned, arms)


def test_cli_generate_prints_the_note(target, monkeypatch, capsys):
    """`specrt generate` with a named drafter prints the note on stderr when it was the slow choice."""
    import argparse

    from specrt.runtime.pipeline import Pipeline
    from specrt.tools import cli_generate

    clock = FakeClock()
    prompt = [5, 9, 23, 5, 9]
    truth = plain(target, [prompt], 48)
    named = AutoProposer(Scripted(truth, right=True), Scripted(truth, right=False, clock=clock, cost=0.05,
                                                                name="slowdrafter"), pinned=DRAFTER, clock=clock)

    class Tok:
        eos_token_ids = ()

        def encode(self, text):
            return prompt

        def encode_chat(self, text, system=None):
            return prompt

        def decode(self, ids):
            return " ".join(map(str, ids))

    p = Pipeline(target, Tok(), named, "tiny", "torch",
                 lambda capacity, batch, spare: CostedEngine(target, capacity, batch, clock))
    monkeypatch.setattr(cli_generate, "build_pipeline", lambda args, options: p)
    parser = argparse.ArgumentParser()
    cli_generate.add_arguments(parser)
    args = parser.parse_args(["--prompt", "x", "--max-new-tokens", "48", "--drafter", "eagle3"])
    assert cli_generate.run(args) == 0
    err = capsys.readouterr().err
    assert "note: slowdrafter ran at" in err and "--drafter auto" in err


def test_a_round_chosen_to_run_plain_runs_the_copies_that_pay(target):
    """Every round is chosen plain here, but where the lookup's own cost cut keeps a copy the round runs
    the copies (counted as a copies round): on a looping prompt with cheap rows that is most rounds,
    with rows that cost more than any copy returns none; greedy output is plain decoding's either way."""
    from test_verify_length import FixedCost

    want = plain(target, LOOPY[:1], 48)
    taus, copy_rounds = [], []
    for line in ((1.0, 0.01), (1.0, 100.0)):
        copies = LookupProposer()
        copies.step_cost = FixedCost(line)
        clock = FakeClock()
        auto = AutoProposer(copies, clock=clock)
        auto._choose = lambda sampling: PLAIN
        result = _run(target, auto, LOOPY[:1], 48, clock)
        assert result.tokens == want
        taus.append(result.stats[0].round_tokens / result.stats[0].rounds)
        copy_rounds.append(auto.summary().get("lookup", {}).get("rounds", 0))
    assert taus[0] > 1.5 and copy_rounds[0] > 0
    assert taus[1] == 1.0 and copy_rounds[1] == 0


def test_a_named_drafter_keeps_its_idle_rounds_under_auto(target):
    """A named drafter runs as auto's pinned arm; its rounds still go idle where sizing cannot pay (a
    plain step of a microsecond), which needs auto to score the drafter arm's rounds for it."""
    from specrt.runtime.proposers.verify_length import MAX_IDLE_SAMPLED
    from test_verify_length import FixedCost

    drafter = WithLookup(eagle3(target), max_tokens=5, threshold=0.0)
    auto = AutoProposer(LookupProposer(), drafter, pinned=DRAFTER, pinned_first_probe=10**6)  # no probes
    auto.copies.step_cost = drafter.step_cost = FixedCost((1e-6, 1e-7))
    sampling = SamplingParams(temperature=1.0, seed=3)
    result = generate_speculative(TorchTargetEngine(target, 256, 1), auto, [PROMPTS[0]], 96, sampling)
    assert result.tokens == plain(target, [PROMPTS[0]], 96, sampling)
    assert drafter.idle.gap == MAX_IDLE_SAMPLED


def test_a_named_drafter_under_auto_carries_its_idle_rule_to_the_next_request(target):
    """`begin_request` reaches both arms: the second request at temperature 1 starts with what the
    first taught the drafter arm's and the copies arm's idle rules."""
    from specrt.runtime.proposers.verify_length import MIN_SIZED
    from test_verify_length import FixedCost

    drafter = WithLookup(eagle3(target), max_tokens=5, threshold=0.0)
    auto = AutoProposer(LookupProposer(), drafter, pinned=DRAFTER, pinned_first_probe=10**6)  # no probes
    auto.copies.step_cost = drafter.step_cost = FixedCost((1e-6, 1e-7))
    sampling = SamplingParams(temperature=1.0, seed=3)
    engine = TorchTargetEngine(target, 256, 1)
    generate_speculative(engine, auto, [PROMPTS[0]], 96, sampling)
    learned = drafter.idle.rounds
    assert learned >= MIN_SIZED
    auto.reset(1, engine.capacity)
    assert drafter.idle.rounds == 0
    auto.begin_request(SamplingParams(temperature=1.0, seed=4))
    assert drafter.idle.rounds == learned and auto.copies.idle.key == drafter.idle.key


def test_the_prompt_waits_for_the_drafters_first_round(target):
    """The drafter ingests a request's prompt only when it first drafts: a request that never runs it
    leaves it all held (nothing ingested), and the next one's drafter drafts from its own prompt alone,
    giving plain decoding's text."""
    drafter = WithLookup(eagle3(target), max_tokens=5)
    auto = AutoProposer(LookupProposer(), drafter, pinned=PLAIN, pinned_first_probe=10**6)  # no probes
    generate_speculative(TorchTargetEngine(target, 256, 1), auto, [PROMPTS[0]], 24, SamplingParams())
    assert drafter.inner.lengths[0] == 0
    # the prompt and every token committed after it (the last round ends the request: not observed)
    assert auto.backlog.held(0) == auto.copies.lengths[0] == len(PROMPTS[0]) + 22

    auto.pinned = DRAFTER
    counts = _counting(auto)
    result = generate_speculative(TorchTargetEngine(target, 256, 1), auto, [PROMPTS[1]], 24, SamplingParams())
    assert result.tokens == plain(target, [PROMPTS[1]], 24)
    assert counts[DRAFTER] > 0
    auto.backlog.catch_up()
    assert drafter.inner.lengths[0] == auto.copies.lengths[0] == len(PROMPTS[1]) + 22


def test_a_held_prompt_is_ingested_apart_from_the_rounds():
    """A catch-up feeds a held prompt in a call of its own, then the rounds' tokens merged in one; the
    rounds' cost (`last`) leaves the prompt's out."""
    from specrt.runtime.proposers.backlog import DrafterBacklog

    calls = []

    class Recorder:
        def observe(self, rows, tokens, taps, next_tokens):
            calls.append((list(rows), [list(t) for t in tokens], [None if t is None else t.shape[0] for t in taps],
                          list(next_tokens)))

    backlog = DrafterBacklog(Recorder())
    backlog.hold([0], [[5, 6, 7]], [torch.zeros(3, 4)], [8], prompt=True)
    backlog.hold([0], [[8, 9]], [torch.zeros(2, 4)], [10])
    backlog.hold([0], [[10]], [torch.zeros(1, 4)], [11])
    assert backlog.held(0) == 6
    with pytest.raises(ValueError, match="a prompt comes first"):
        backlog.hold([0], [[1]], [None], [2], prompt=True)
    backlog.catch_up()
    assert calls == [([0], [[5, 6, 7]], [3], [8]), ([0], [[8, 9, 10]], [3], [11])]
    assert backlog.last[1] == 2 and backlog.prompt_seconds > 0 and backlog.held(0) == 0
    backlog.clear_last()
    assert backlog.prompt_seconds == 0.0
