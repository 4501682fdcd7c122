"""The Python API for apps: load a target (and its drafter) once, generate many times.

    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.from_engines("engines/SmolLM2-135M-Instruct-eagle3", threads=2)   # ONNX Runtime, --drafter auto
    out = pipe.generate("Why is the sky blue?", max_new_tokens=128)
    print(out.text, out.stats.tau, out.tokens_per_second)
    pipe.generate("Tell me a joke", temperature=0.7, seed=1, on_text=print)          # streaming, seeded
    pipe.generate("Hi", speculative=False)                                           # plain decoding

    pipe = Pipeline.from_checkpoint(drafter="dspark", drafter_ckpt="runs/dspark/drafter")   # torch
    pipe = Pipeline.from_engines("engines/NAME", drafter="lookup")    # copies from the text, no drafter

Both constructors give the same object over the same loop (`specrt.runtime.generate.generate`: one
`specrt.runtime.step.DecodeStep` per round, with or without drafts); only the engine behind it
differs. A seed gives the same text with or without the drafter, and the same as `specrt serve`.
The KV cache is allocated once, sized for the longest request so far (it grows, never shrinks), so
repeated calls allocate nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from specrt.plugins.errors import SpecrtError
from specrt.runtime.host_threads import ORT_HOST_THREADS, torch_threads
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.stats import RequestStats

CACHE_MARGIN = 64  # slots beyond prompt + max_new_tokens, so small follow-ups reuse the cache


@dataclass
class Generation:
    text: str
    tokens: list[int]
    prompt_tokens: int
    stats: RequestStats
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


class Pipeline:
    def __init__(self, model, tokenizer, proposer, name: str, backend: str,
                 engine_factory: Callable[[int, int, int], Any]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.name = name
        self.backend = backend
        self._engine_factory = engine_factory
        self._engine = None
        self.config = model.config
        self.source: str | None = None  # the target checkpoint the weights came from (GGUF / HF folder)
        self.folder: Path | None = None  # the engine folder (ort backend)
        # torch threads during generation: one on ORT, where torch only does host work (host_threads.py)
        self.host_threads: int | None = ORT_HOST_THREADS if backend == "ort" else None

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def from_engines(cls, folder: str | Path, device: str = "cpu", threads: int | None = None,
                     drafter: str = "auto", draft_options=None, verify_checksums: bool = True,
                     exact_plain: bool = True, measured: bool = True) -> "Pipeline":
        """An engine folder written by `specrt export`, run by ONNX Runtime.

        drafter: "auto" (the default) runs, round by round, whichever of plain steps, copies from the
        text and the folder's drafter (where it has one) measures the most tokens per second
        (`specrt.runtime.proposers.auto`); "none" decodes plainly; a kind ("eagle3", ...) insists on
        the folder's drafter of that kind; "lookup" speculates with copies from the text alone (any
        folder; `specrt.runtime.proposers.lookup`).
        measured: a named drafter (or "lookup") is measured against plain steps and the copies in
        occasional probe rounds: while plain rounds measure faster (text or sampling where its drafts
        rarely land) the rounds run plain, in runs of plain steps between probes (what that costs
        against plain decoding at temperature 1: docs/results.md, "Temperature 1"), and
        `proposer.slower_note()` says when the automatic choice was faster. False: the named proposer
        drafts every round (what acceptance measurements need).
        exact_plain: False trades plain decoding's exactness on int8-activation engines for speed: one-row
        steps on the causal graph (`load_engines`); speculative output is exact either way.
        """
        from specrt.runtime.backends.ort_backend import OrtTargetEngine, load_engines
        from specrt.runtime.backends.ort_session import SessionOptions

        options = SessionOptions(device=device, threads=threads)
        lookup_only = drafter == "lookup"  # needs no drafter graph: any engine folder can run it
        # auto verifies copies on any folder: the target is set up for speculation (load_engines)
        engines = load_engines(folder, options, with_drafter=drafter not in ("none", "lookup"),
                               verify_checksums=verify_checksums, lookup_only=drafter in ("lookup", "auto"),
                               exact_plain=exact_plain)
        if drafter not in ("auto", "none", "lookup") and engines.drafter_kind != drafter:
            raise SpecrtError(
                f"{folder} holds a {engines.drafter_kind or 'target-only'} engine, not {drafter}",
                f"export one with --drafter {drafter}, or leave --drafter at auto to use the folder's own",
            )
        if drafter == "none":
            proposer = None
        elif drafter == "auto":
            proposer = engines.proposer(draft_options, measured="auto")
        else:
            proposer = engines.proposer(draft_options, lookup_only=lookup_only,
                                        measured="named" if measured else None)
        pipe = cls(engines.target, engines.tokenizer, proposer, engines.name, "ort",
                   lambda capacity, batch, spare: OrtTargetEngine(engines.target, capacity, batch, spare_slots=spare))
        pipe.source = engines.manifest.data["target"].get("source")
        pipe.folder = Path(folder)
        return pipe

    @classmethod
    def from_checkpoint(cls, target: str | Path | None = None, drafter: str = "none", drafter_ckpt: str | Path | None = None,
                        device: str = "cpu", dtype=None, draft_options=None) -> "Pipeline":
        """A target checkpoint (HF folder / GGUF; default: the embedded SmolLM2) on the torch backend."""
        from specrt.export.checkpoints import load_target
        from specrt.runtime.backends.torch_backend import TorchTargetEngine
        from specrt.runtime.proposers.factory import load_proposer

        loaded = load_target(target, dtype) if dtype is not None else load_target(target)
        model = loaded.model.to(device)
        proposer = None
        if drafter != "none":
            shipped_for = loaded.name if target is None else None  # shipped drafters fit the default only
            proposer = load_proposer(drafter, drafter_ckpt, model, draft_options, shipped_for)
        pipe = cls(model, loaded.tokenizer, proposer, loaded.name, "torch",
                   lambda capacity, batch, spare: TorchTargetEngine(model, capacity, batch, spare_slots=spare))
        pipe.source = str(loaded.source)
        return pipe

    def with_proposer(self, proposer) -> "Pipeline":
        """A pipeline over the same loaded target (sessions / weights shared) with another proposer."""
        pipe = Pipeline(self.model, self.tokenizer, proposer, self.name, self.backend, self._engine_factory)
        pipe.source, pipe.folder = self.source, self.folder
        return pipe

    # -- generation ------------------------------------------------------------------------------
    def encode(self, prompt: str, system: str | None = None, chat: bool = True) -> list[int]:
        return self.tokenizer.encode_chat(prompt, system) if chat else self.tokenizer.encode(prompt)

    def engine_for(self, needed: int, batch: int = 1):
        """The target engine, (re)allocated only when a request needs more slots or another batch."""
        limit = self.config.max_position_embeddings
        if needed > limit:
            raise SpecrtError(
                f"the request needs {needed} positions but {self.name} supports {limit}",
                "shorten the prompt or lower max_new_tokens",
            )
        engine = self._engine
        if engine is None or engine.capacity < needed or engine.batch_size != batch:
            capacity = min(limit, max(needed + CACHE_MARGIN, engine.capacity if engine is not None else 0))
            self._engine = engine = self._engine_factory(capacity, batch, _spare_slots(self.proposer))
        return engine

    def generate_ids(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 256,
                     sampling: SamplingParams | None = None, speculative: bool = True,
                     on_tokens: Callable[[int, list[int]], None] | None = None, capacity: int | None = None,
                     seeded_sampling: str = "noise"):
        """Token-level batch generation: the loop's GenerationResult.

        capacity: a fixed KV cache size (generation stops when it is full) instead of one sized to the request.
        seeded_sampling: "noise" (a seed fixes the text: `specrt.runtime.seeded`) or "stream" (rejection
        sampling with coins from the seed: accepts more drafts, reproducible for the same drafter only).
        """
        from specrt.runtime.generate import generate

        sampling = sampling or SamplingParams()
        if max_new_tokens < 1:
            raise SpecrtError(f"max_new_tokens must be >= 1, got {max_new_tokens}", "ask for at least one token")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise SpecrtError("empty prompt", "give at least one token of prompt text")
        engine = self.engine_for(capacity or max(len(p) for p in prompts) + max_new_tokens, len(prompts))
        if capacity and engine.capacity != capacity:
            self._engine = engine = self._engine_factory(capacity, len(prompts), _spare_slots(self.proposer))
        eos = self.config.eos_token_ids
        with torch_threads(self.host_threads):
            return generate(engine, self.proposer if speculative else None, prompts, max_new_tokens, sampling, eos,
                            on_tokens, seeded_sampling)

    def generate(self, prompt: str, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, system: str | None = None, chat: bool = True,
                 speculative: bool = True, on_text: Callable[[str], None] | None = None) -> Generation:
        from specrt.runtime.streaming import TextStream

        sampling = SamplingParams(temperature, top_k, top_p, seed)
        ids = self.encode(prompt, system, chat)
        stream = TextStream(self.tokenizer, on_text) if on_text is not None else None
        start = time.perf_counter()
        result = self.generate_ids([ids], max_new_tokens, sampling, speculative,
                                   (lambda row, new: stream.push(new)) if stream is not None else None)
        seconds = time.perf_counter() - start
        if stream is not None:
            stream.close()
        tokens = result.tokens[0]
        return Generation(self.tokenizer.decode(tokens), tokens, len(ids), result.stats[0], seconds)


def _spare_slots(proposer) -> int:
    return 64 if proposer is None else max(64, proposer.max_drafts + 1)
