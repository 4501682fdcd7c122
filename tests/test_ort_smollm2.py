"""The shipped drafters on the real default target, exported and run by ONNX Runtime: lossless on
MT-bench prompts (ORT speculative greedy == torch plain greedy, first 128 tokens), and the drafts
are accepted (a drafter that never hits would pass the lossless check trivially). The full 80-prompt
check is `specrt bench --engines ...` (docs/results.md)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from specrt.export.default_model import DEFAULT_NAME
from specrt.export.shipped import shipped_drafter

pytest.importorskip("onnxruntime")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)
pytestmark = pytest.mark.slow

KINDS = ("eagle3", "dflash", "dspark")
PROMPT_INDICES = (0, 17, 45)  # writing, reasoning, coding first turns
TOKENS = 128


@pytest.fixture(scope="module")
def prompts(default_target):
    from specrt.tools.datasets import mtbench_questions

    questions = mtbench_questions()
    return [default_target.tokenizer.encode_chat(questions[i]["turns"][0]) for i in PROMPT_INDICES]


@pytest.fixture(scope="module")
def plain_tokens(default_target, prompts):
    from specrt.runtime.backends.torch_backend import TorchTargetEngine
    from specrt.runtime.generate import generate_autoregressive
    from specrt.runtime.sampling import SamplingParams

    model = default_target.model
    model.set_taps(())
    engine = TorchTargetEngine(model, max(map(len, prompts)) + TOKENS + 8, len(prompts))
    return generate_autoregressive(engine, prompts, TOKENS, SamplingParams(0.0), model.config.eos_token_ids).tokens


@pytest.mark.parametrize("kind", KINDS)
def test_shipped_drafter_on_ort_is_lossless_and_accepts(kind, default_target, prompts, plain_tokens, tmp_path):
    from specrt.export.draft_options import folder_draft_options
    from specrt.export.export import export_engine
    from specrt.runtime.pipeline import Pipeline
    from specrt.tools.cli_export import copy_files_for

    assert shipped_drafter(kind, DEFAULT_NAME) is not None, f"no {kind} drafter ships for {DEFAULT_NAME}"
    # the EAGLE-3 folder gets the copy hit rates and datastore of the shipped data; the
    # others skip them (~25 s an export; these checks draft without copies)
    with_files = kind == "eagle3"
    folder = export_engine(kind, out=tmp_path / f"smollm2-{kind}", quiet=True, loaded_target=default_target,
                           extra_files=copy_files_for if with_files else None)
    assert (folder / "datastore.npz").exists() == with_files and (folder / "lookup.json").exists() == with_files
    alone = dataclasses.replace(folder_draft_options(folder), lookup=0)  # the drafter's own drafts
    pipe = Pipeline.from_engines(folder, threads=2, drafter=kind, draft_options=alone, measured=False)
    assert pipe.proposer.name == kind
    result = pipe.generate_ids(prompts, TOKENS)
    assert result.tokens == plain_tokens
    accepted = sum(sum(s.accepted_per_position) for s in result.stats)
    rounds = sum(s.rounds for s in result.stats)
    assert accepted > 0.1 * rounds, f"{kind}: {accepted} drafts accepted in {rounds} rounds"
