"""Milliseconds per target forward, by number of new tokens, for an engine folder's target graphs.

    python -m specrt.tools.bench_graph_step --engines engines/a,engines/b --tokens 1,2,4,8,16 --context 300

For each folder: the portable graph (`target`) and, when the folder has it, the ORT-fused graph
plain decoding loads (`target_ort`, or its causal twin `target_ort_causal` for one-row steps), both
called through the runtime's `OrtTargetModel` (IO binding and mask building
included), interleaved over repeats so machine noise hits every configuration alike. This is the
cost curve the drafters' verify sizes are chosen against: on a CPU a verify step of T tokens costs
more than a decode step as soon as the weights stop dominating (int4: early).

    python -m specrt.tools.bench_graph_step --engines engines/a --decode 256 --prompts 8

--decode N: where a plain decoding step's time goes instead. Each folder decodes N greedy tokens of
the first --prompts MT-bench first turns through `Pipeline` (the path `specrt generate` takes), and
the table splits a step's milliseconds into the target graph's call (time inside ONNX Runtime) and
the host work around it (the loop, masks, bindings, argmax), prefill excluded, for the engine's
bound call (`specrt.runtime.backends.ort_decode`) and its general path, interleaved. Host work is
given twice: wall time outside the graph call, and the CPU time the loop's thread spends outside
it (the steadier number on a busy machine: other processes do not inflate it). On int4/int8/w8a8
folders plain decoding is timed both ways: exact (attention rows on `target_ort`, the speculative
decoder's text) and in one-row steps (`--fast-plain`: the causal graph `target_ort_causal`).

    python -m specrt.tools.bench_graph_step --engines engines/int4-none --decode 256 --prompts 8 --genai

--genai: onnxruntime-genai's int4 model of the same target decodes the same prompts in the same
rounds (its builder's model, built once by `specrt bench --compare ort-genai`); its row has the step
only, a generate_next_token call from the first token to the last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specrt.runtime.backends.ort_backend import load_engines
from specrt.runtime.backends.ort_session import SessionOptions


def step_ms(model, tokens: int, context: int, repeats: int) -> float:
    k, v = model.new_cache(1, context + tokens + 8)
    ids = torch.ones(1, tokens, dtype=torch.long)
    pos = torch.arange(context, context + tokens)[None]
    mask = torch.ones(1, tokens, context + tokens, dtype=torch.bool)
    mask[0, :, context:] = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool))
    for _ in range(2):
        model(ids, pos, mask, k, v, pos)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids, pos, mask, k, v, pos)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


class TimedSession:
    """An InferenceSession whose IO-binding runs are timed: wall seconds, and CPU seconds of the
    calling thread (host work measured as thread CPU time is not inflated by other processes)."""

    def __init__(self, session) -> None:
        self.session = session
        self.wall = self.cpu = 0.0

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run_with_iobinding(self, binding, run_options=None) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self.session.run_with_iobinding(binding, run_options)
        self.wall += time.perf_counter() - wall
        self.cpu += time.thread_time() - cpu


def decode_split(pipe, prompts, tokens: int, bound: bool = True) -> tuple[float, float, float, int]:
    """(step ms, graph ms, host CPU ms) per plain decoding step over `prompts`, and the steps timed.
    bound False: the engine's general path instead of its bound call (`OrtTargetEngine.lean_decode`)."""
    graph = pipe.model.fused or pipe.model.graph
    if not isinstance(graph.session, TimedSession):
        graph.session = TimedSession(graph.session)
    timed = graph.session
    total = inside = host = 0.0
    steps = 0
    for prompt in prompts:
        pipe.engine_for(len(prompt) + tokens).lean_decode = bound
        marks = {}

        def first(row, new, marks=marks):  # called once prefill has given the first token
            marks.setdefault("start", (time.perf_counter(), timed.wall, time.thread_time(), timed.cpu))

        result = pipe.generate_ids([prompt], tokens, on_tokens=first)
        end = (time.perf_counter(), timed.wall, time.thread_time(), timed.cpu)
        start = marks["start"]
        total += end[0] - start[0]
        inside += end[1] - start[1]
        host += (end[2] - start[2]) - (end[3] - start[3])
        steps += result.stats[0].rounds
    return 1e3 * total / steps, 1e3 * inside / steps, 1e3 * host / steps, steps


def genai_step_ms(model, prompts, tokens: int) -> float:
    """onnxruntime-genai's ms per greedy decoding step over `prompts`, prefill excluded."""
    import onnxruntime_genai as og

    seconds, steps = 0.0, 0
    for prompt in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + tokens, batch_size=1, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(list(prompt))
        generator.generate_next_token()  # the prompt's call gives the first token
        start, made = time.perf_counter(), 1
        while not generator.is_done() and made < tokens:
            generator.generate_next_token()
            made += 1
        seconds += time.perf_counter() - start
        steps += made - 1
    return 1e3 * seconds / steps


def genai_model(pipe, threads: int):
    """onnxruntime-genai's int4 model of the pipeline's target (`specrt.tools.peers`, built once)."""
    import onnxruntime_genai as og

    from specrt.tools.bench import loaded_target_for_peers
    from specrt.tools.peers import build_genai_model

    return og.Model(str(build_genai_model(loaded_target_for_peers(pipe), "int4", threads)))


def main_decode(args) -> int:
    from specrt.runtime.pipeline import Pipeline
    from specrt.tools.datasets import mtbench_questions

    pipes = {}
    for folder in args.engines.split(","):
        name = folder.rstrip("/").rsplit("/", 1)[-1]
        exact = Pipeline.from_engines(folder, threads=args.threads, drafter="none")
        pipes[name] = exact
        if exact.model.attention_row_decode:  # one-row steps round otherwise here: timed beside it
            pipes[f"{name}, one-row steps"] = Pipeline.from_engines(folder, threads=args.threads, drafter="none",
                                                                    exact_plain=False)
    genai = genai_model(next(iter(pipes.values())), args.threads) if args.genai else None
    questions = [q["turns"][0] for q in mtbench_questions()[: args.prompts]]
    paths = {"bound call": True, "general path": False}
    results: dict[str, list[tuple[float, float, float, int]]] = {f"{n} ({p})": [] for n in pipes for p in paths}
    genai_steps: list[float] = []
    for r in range(args.rounds):
        for name, pipe in pipes.items():
            prompts = [pipe.encode(q) for q in questions]
            order = list(paths.items()) if r % 2 == 0 else list(paths.items())[::-1]
            for path, bound in order:
                results[f"{name} ({path})"].append(decode_split(pipe, prompts, args.decode, bound))
        if genai is not None:
            genai_steps.append(genai_step_ms(genai, prompts, args.decode))
    print(f"plain decoding, ms per step ({args.prompts} MT-bench prompts x {args.decode} tokens, {args.threads} "
          f"threads, median of {args.rounds} rounds)\n")
    print("| engine | step | graph | host (wall) | host (CPU of the loop's thread) | tok/s (decode) |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        step, graph, host = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"| {name} | {step:.2f} | {graph:.2f} | {step - graph:.2f} | {host:.3f} | {1e3 / step:.1f} |")
    if genai_steps:
        step = statistics.median(genai_steps)
        print(f"| onnxruntime-genai int4 (generate_next_token) | {step:.2f} | | | | {1e3 / step:.1f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", required=True, help="comma list of engine folders")
    p.add_argument("--tokens", default="1,2,4,8,16", help="new tokens per call")
    p.add_argument("--context", type=int, default=300, help="committed tokens before the call")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows the median")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode", type=int, default=0,
                   help="time N plain decoding steps per prompt instead: graph vs host split (docstring)")
    p.add_argument("--prompts", type=int, default=4, help="--decode: MT-bench first turns to decode")
    p.add_argument("--genai", action="store_true",
                   help="--decode: time onnxruntime-genai's int4 model of the same target too (docstring)")
    args = p.parse_args(argv)
    if args.decode:
        return main_decode(args)
    tokens = [int(t) for t in args.tokens.split(",")]
    configs = {}
    for folder in args.engines.split(","):
        name = folder.rstrip("/").rsplit("/", 1)[-1]
        for fused in (False, True):
            engines = load_engines(folder, SessionOptions(threads=args.threads), with_drafter=False, use_fused=fused)
            if fused and engines.target.fused is None:
                continue
            graph = engines.target.fused.path.stem if fused else "target"  # target_ort_causal where it serves
            configs[f"{name} ({graph})"] = engines.target
    results: dict[str, dict[int, list[float]]] = {c: {t: [] for t in tokens} for c in configs}
    for _ in range(args.rounds):
        for label, model in configs.items():
            for t in tokens:
                results[label][t].append(step_ms(model, t, args.context, args.repeats))
    print(f"ms per target forward at context {args.context}, {args.threads} threads (median of {args.rounds} rounds)\n")
    print("| graph | " + " | ".join(f"T={t}" for t in tokens) + " |")
    print("|---|" + "---|" * len(tokens))
    for label, row in results.items():
        print(f"| {label} | " + " | ".join(f"{statistics.median(row[t]):.1f}" for t in tokens) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
