"""Instructions written by the target itself (Magpie): a second prompt source that needs no data set.

    prompts = magpie_prompts(target, num=1024, max_prompt_tokens=256, seed=0, batch_size=64,
                             log=folder / "magpie_instructions.jsonl")

Why: ShareGPT first turns are one narrow slice of what users ask; MT-bench's first turns (writing,
roleplay, reasoning, math, coding, extraction, STEM, humanities) are further from them than
held-out ShareGPT is, and a drafter trained on ShareGPT alone loses a third of its acceptance
there (docs/training.md). An instruction-tuned target has learned what user turns look
like: given only its chat template up to the start of a user turn (the "pre-query template", Xu et
al. 2024, "Magpie"), it samples a plausible user request and closes the turn with its end-of-turn
token. SmolLM2-Instruct was itself tuned on such data, so its samples span the same task mix
(advice, writing, coding, math, explanation, role play) without any download. The responses are
then regenerated greedily by the same builder as ShareGPT's.

How: batches of `batch_size` rows sample from the pre-query prefix (temperature 1, top-p 0.98,
seed = f(seed, batch)), at most `MAX_INSTRUCTION_TOKENS` tokens each. A sample is kept when it is a
complete turn (it ended with an end-of-turn token), has at least `MIN_WORDS` words, is mostly ASCII
text (the small target drifts into other scripts now and then), has no chat markers, is not a
duplicate (case and whitespace folded) and fits `max_prompt_tokens` once wrapped in the chat
template. Each batch's kept texts are appended to `log` as one JSON line, so an interrupted run
resumes at the next batch and reproduces the same set (the kept texts are a pure function of the
seed, the target and the torch build).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specrt.plugins.errors import SpecrtError

MAX_INSTRUCTION_TOKENS = 128
MIN_WORDS = 4
MIN_ASCII_FRACTION = 0.95
TEMPERATURE = 1.0
TOP_P = 0.98
USER_MARKER = "\x00SPECRT_USER\x00"


def pre_query_prefix(tokenizer) -> str:
    """The chat template rendered up to where the user's words would start."""
    rendered = tokenizer.render_chat([{"role": "user", "content": USER_MARKER}])
    if USER_MARKER not in rendered:
        raise SpecrtError("the target's chat template does not place the user message verbatim",
                          "use --source sharegpt for this target")
    return rendered[: rendered.index(USER_MARKER)]


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


def keep_instruction(text: str, complete: bool) -> bool:
    """The filter of the module docstring (without duplicates and the length limit)."""
    if not complete or len(text.split()) < MIN_WORDS or "<|" in text:
        return False
    ascii_chars = sum(1 for ch in text if ord(ch) < 128)
    return ascii_chars / max(1, len(text)) >= MIN_ASCII_FRACTION


def _read_log(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    batches = []
    for line in log.read_text().splitlines():
        if line.strip():
            batches.append(json.loads(line)["kept"])
    return batches


def magpie_prompts(target, num: int, max_prompt_tokens: int, seed: int, batch_size: int, log: Path,
                   progress: bool = True) -> list[tuple[str, list[int]]]:
    """`num` (conversation id, chat-template prompt ids) pairs of target-written instructions."""
    from specrt.runtime.backends.torch_backend import TorchTargetEngine
    from specrt.runtime.generate import generate_autoregressive
    from specrt.runtime.sampling import SamplingParams
    from tqdm import tqdm

    tokenizer = target.tokenizer
    eos = set(target.model.config.eos_token_ids)
    prefix_ids = tokenizer.encode(pre_query_prefix(tokenizer))
    chosen: list[tuple[str, list[int]]] = []
    seen: set[str] = set()

    def admit(batch_index: int, texts: list[str]) -> None:
        for row, text in enumerate(texts):
            key = normalized(text)
            ids = tokenizer.encode_chat(text)
            if key in seen or len(ids) > max_prompt_tokens or len(chosen) >= num:
                continue
            seen.add(key)
            chosen.append((f"magpie-{seed}-{batch_index}-{row}", ids))

    done = _read_log(log)
    for index, texts in enumerate(done):
        admit(index, texts)
    # a cap so that a target that never closes its turns fails instead of looping forever
    max_batches = max(8, 4 * -(-num // batch_size))
    bar = tqdm(total=num, initial=len(chosen), desc="magpie instructions", unit="prompt", file=sys.stderr,
               disable=not progress)
    engine = None
    index = len(done)
    while len(chosen) < num:
        if index >= max_batches:
            raise SpecrtError(f"only {len(chosen)} usable instructions after {index} batches of {batch_size}",
                              "the target rarely ends its sampled user turns; use --source sharegpt")
        if engine is None:
            engine = TorchTargetEngine(target.model, len(prefix_ids) + MAX_INSTRUCTION_TOKENS + 1, batch_size)
        sampling = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=seed * 1_000_003 + index)
        result = generate_autoregressive(engine, [prefix_ids] * batch_size, MAX_INSTRUCTION_TOKENS, sampling, eos)
        kept = []
        for tokens in result.tokens:
            complete = bool(tokens) and tokens[-1] in eos
            text = tokenizer.decode(tokens[:-1] if complete else tokens).strip()
            if keep_instruction(text, complete):
                kept.append(text)
        with log.open("a") as fh:
            fh.write(json.dumps({"batch": index, "sampled": batch_size, "kept": kept}) + "\n")
        before = len(chosen)
        admit(index, kept)
        bar.update(len(chosen) - before)
        index += 1
    bar.close()
    return chosen
