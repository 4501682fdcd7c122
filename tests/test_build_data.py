"""The data builder's batch plan and its resume guard (no target, no ShareGPT needed)."""

from __future__ import annotations

import gzip
import json
import random

import pytest
from specrt.export.errors import SpecrtError
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
