"""The datastore-size bench (`specrt.tools.bench_store`): its option checks, prompt choice and table."""

from __future__ import annotations

import pytest
from specrt.plugins.errors import SpecrtError
from specrt.tools.bench_store import parse_fractions, render, stride_prompts


def test_fractions_are_checked_and_sorted():
    assert parse_fractions("1,0,0.25,0.25") == [0.0, 0.25, 1.0]
    for bad in ("", "a,1", "1.5", "-0.1"):
        with pytest.raises(SpecrtError, match="--fractions"):
            parse_fractions(bad)


def test_prompts_are_spread_over_every_category():
    questions = [{"question_id": i, "category": f"c{i // 10}"} for i in range(80)]
    picked = stride_prompts(questions, 8)
    assert [q["category"] for q in picked] == [f"c{i}" for i in range(8)]
    assert len(stride_prompts(questions, 500)) == 80 and len(stride_prompts(questions, 0)) == 1


def test_the_table_shows_each_variant_against_plain():
    report = {"engines": "engines/x", "threads": 2, "prompts": 4, "max_new_tokens": 64, "results": [
        {"variant": "plain", "answers": None, "tau": None, "tok_s": 50.0, "vs_plain": 1.0, "same_as_plain": 4, "prompts": 4},
        {"variant": "own text only", "answers": 0, "tau": 1.5, "tok_s": 60.0, "vs_plain": 1.2, "same_as_plain": 4, "prompts": 4},
        {"variant": "store 1 (100 answers)", "answers": 100, "tau": 2.0, "tok_s": 75.0, "vs_plain": 1.5,
         "same_as_plain": 3, "prompts": 4}]}
    table = render(report)
    assert "| plain |  |  | 50.0 | 1.00x | 4/4 |" in table
    assert "| store 1 (100 answers) | 100 | 2.00 | 75.0 | 1.50x | 3/4 |" in table
