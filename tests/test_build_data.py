"""The data builder's batch plan and its resume guard (no target, no ShareGPT needed)."""

from __future__ import annotations

import gzip
import json
import random

import pytest
from specrt.plugins.errors import SpecrtError
from specrt.tools.build_data import BATCH_ORDER, check_resumable, plan_batches

SETTINGS = {"num_prompts": 40, "max_prompt_tokens": 256, "max_new_tokens": 256, "batch_size": 4, "seed": 0,
            "batch_order": BATCH_ORDER}


def _prompts(n: int = 40) -> list[tuple[str, list[int]]]:
    rng = random.Random(1)
    return [(f"c{i}", [7] * rng.randint(3, 200)) for i in range(n)]


def test_batches_share_a_length_range_and_run_in_a_seeded_random_order():
    prompts = _prompts()
    batches = plan_batches(prompts, 4, seed=0)
    assert sorted(c for b in batches for c, _ in b) == sorted(c for c, _ in prompts)  # each prompt once
    # batches are cuts of the length-sorted list: their length ranges never interleave
    ranges = sorted((min(len(i) for _, i in b), max(len(i) for _, i in b)) for b in batches)
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(ranges, ranges[1:]))
    # ... but they do not run shortest first, so a half-built set is not the short half
    first_half = [len(ids) for b in batches[:5] for _, ids in b]
    sorted_lengths = sorted(len(ids) for _, ids in prompts)
    assert max(first_half) > sorted_lengths[len(sorted_lengths) // 2]
    assert plan_batches(prompts, 4, seed=0) == batches  # resumable: a pure function of the seed
    assert plan_batches(prompts, 4, seed=1) != batches
    with pytest.raises(SpecrtError, match="batch-size"):
        plan_batches(prompts, 0, seed=0)


def _folder(tmp_path, manifest: dict, shards: int = 1):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    for i in range(shards):
        (tmp_path / f"shard_{i:05d}.json.gz").write_bytes(gzip.compress(b'{"ids":[],"prompt":[],"response":[]}'))
    return tmp_path


def test_resume_guard(tmp_path):
    assert check_resumable(tmp_path / "new", SETTINGS) is False  # nothing there yet
    same = {k: v for k, v in SETTINGS.items()}
    assert check_resumable(_folder(tmp_path / "partial", same), SETTINGS) is False  # resume it
    assert check_resumable(_folder(tmp_path / "done", {**same, "built": {"complete": True}}), SETTINGS) is True
    # the first builder's sets (no batch_order: shortest first) may not be resumed with this order ...
    old = {k: v for k, v in SETTINGS.items() if k != "batch_order"}
    with pytest.raises(SpecrtError, match="batch order 'length-sorted'"):
        check_resumable(_folder(tmp_path / "old", old), SETTINGS)
    # ... but a complete one needs nothing more
    assert check_resumable(_folder(tmp_path / "old_done", {**old, "built": {"complete": True}}), SETTINGS) is True
    # fewer prompts fit than were asked for: the request, not the count, decides
    fewer = {**same, "num_prompts": 38, "requested_prompts": 40}
    assert check_resumable(_folder(tmp_path / "fewer", fewer), SETTINGS) is False
    with pytest.raises(SpecrtError, match="same settings"):
        check_resumable(_folder(tmp_path / "other", {**same, "num_prompts": 80}), SETTINGS)


# -- magpie: instructions the target writes itself ----------------------------------------------
class CharTokenizer:
    """One id per character; a chat template with visible markers."""

    def render_chat(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + "<assistant>"

    def encode(self, text):
        return [ord(c) for c in text]

    def encode_chat(self, prompt):
        return self.encode(self.render_chat([{"role": "user", "content": prompt}]))

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


EOS = 3


def _sampled_rows(batch_index: int) -> list[list[int]]:
    enc = CharTokenizer().encode
    return [
        enc("Write a poem about the sea.") + [EOS],  # kept (once)
        enc("Tell me a long story about"),  # no end of turn: cut off, dropped
        enc("Hi there") + [EOS],  # too short
        enc("Привет, как дела сегодня, друг?") + [EOS],  # not the target's main language
        enc("write a  POEM about the sea.") + [EOS],  # a duplicate once case and spaces are folded
        enc(f"Explain topic number {batch_index} in detail.") + [EOS],  # new in every batch
    ]


def _fake_generation(monkeypatch, calls):
    import types

    import specrt.runtime.backends.torch_backend as tb
    import specrt.runtime.generate as gen

    def generate(engine, prompts, max_new_tokens, sampling, eos):
        calls.append((len(prompts), sampling.temperature, sampling.seed))
        assert prompts[0] == CharTokenizer().encode("<user>") and set(eos) == {EOS}
        return types.SimpleNamespace(tokens=_sampled_rows(sampling.seed % 1_000_003))  # the batch's number

    monkeypatch.setattr(tb, "TorchTargetEngine", lambda model, capacity, batch: object())
    monkeypatch.setattr(gen, "generate_autoregressive", generate)


def test_magpie_keeps_complete_distinct_instructions_and_resumes(tmp_path, monkeypatch):
    import types

    from specrt.tools.magpie import magpie_prompts, pre_query_prefix

    tok = CharTokenizer()
    assert pre_query_prefix(tok) == "<user>"
    target = types.SimpleNamespace(tokenizer=tok, model=types.SimpleNamespace(config=types.SimpleNamespace(eos_token_ids=[EOS])))
    calls: list = []
    _fake_generation(monkeypatch, calls)
    log = tmp_path / "magpie_instructions.jsonl"
    got = magpie_prompts(target, 3, 256, seed=5, batch_size=6, log=log, progress=False)
    texts = [tok.decode(ids)[len("<user>"):-len("</><assistant>")] for _, ids in got]
    assert texts == ["Write a poem about the sea.", "Explain topic number 0 in detail.",
                     "Explain topic number 1 in detail."]
    assert len(calls) == 2 and all(t == 1.0 for _, t, _ in calls) and calls[0][2] != calls[1][2]
    assert len({i for i, _ in got}) == 3
    # resumed from the log: no sampling, the same prompts and ids
    calls.clear()
    assert magpie_prompts(target, 3, 256, seed=5, batch_size=6, log=log, progress=False) == got and not calls
    # asking for more continues after the logged batches
    more = magpie_prompts(target, 4, 256, seed=5, batch_size=6, log=log, progress=False)
    assert more[:3] == got and len(calls) == 1
    # the prompt limit applies to the templated prompt
    # the prompt limit applies to the templated prompt (47 tokens for the poem, 53 for the topics)
    short = magpie_prompts(target, 1, 50, seed=5, batch_size=6, log=tmp_path / "short.jsonl", progress=False)
    assert [len(ids) for _, ids in short] == [47]


def test_magpie_fails_clearly_when_the_target_never_ends_a_turn(tmp_path, monkeypatch):
    import types

    import specrt.runtime.generate as gen
    from specrt.tools.magpie import magpie_prompts

    tok = CharTokenizer()
    target = types.SimpleNamespace(tokenizer=tok, model=types.SimpleNamespace(config=types.SimpleNamespace(eos_token_ids=[EOS])))
    _fake_generation(monkeypatch, [])
    monkeypatch.setattr(gen, "generate_autoregressive",
                        lambda *a, **k: types.SimpleNamespace(tokens=[tok.encode("never ends its turn at all")] * 4))
    with pytest.raises(SpecrtError, match="--source sharegpt"):
        magpie_prompts(target, 10, 256, seed=0, batch_size=4, log=tmp_path / "log.jsonl", progress=False)
