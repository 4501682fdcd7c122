"""Serving throughput and latency at several concurrencies: plain vs fixed vs scheduled speculation.

    python -m specrt.tools.bench_serving --engines engines/A,engines/B --concurrency 1,2,4,8,16 --out runs/bench-serving
    specrt bench-serving --backend torch --drafters dspark=runs/dspark/drafter --concurrency 1,4,16
    specrt bench-serving --url http://127.0.0.1:8000 --concurrency 1,4,16 --label ray-2x1   (any OpenAI endpoint:
                                                                  tools/bench_http.py)

What runs: for every concurrency c, c closed-loop clients (a finished request is replaced at once
by the next one) drive the same `Batcher` the server runs, in-process (no HTTP, so the numbers are
the engine's), with c KV rows. Modes per drafter:
  plain      the target alone (the same for every drafter: measured once)
  fixed      every draft verified as proposed (`--schedule fixed`)
  scheduled  DSpark's Algorithm 1 over the drafts' survivals and SPS(B), draft gate and measured
             gate on (`--schedule confidence`; the measured gate runs plain steps wherever speculative
             steps measured slower, column "measured-plain steps"); SPS from the engine folder's
             sps.json, else a quick profile.
             A drafter with copies grafted on (X+lookup) still verifies copies while the gate
             keeps its forward off ("copy-only steps").
--lookup-alone adds the drafter-free lookup proposer (copies from the text; a target-only folder
is enough); copy survivals come from the folder's lookup.json (`specrt calibrate`) when it has one.
Measured per run: throughput (generated tokens / wall time of the run), per-request latency
(submit -> last token) p50/p90, time to first token p50, tau (tokens per request-step). With
--repeats > 1 every configuration runs that many times, interleaved, and the table shows the mean
and the spread (min..max) of the throughput, so "never slower than plain" can be judged against it.
Greedy runs check every request's tokens against plain decoding's (column `same`).
Writes serving.json, serving.md and serving.png to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

MODES = ("plain", "fixed", "scheduled")


def add_arguments(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("a running server (tools/bench_http.py)")
    h.add_argument("--url", help="measure this OpenAI endpoint over HTTP (specrt serve, specrt serve --ray, any other) "
                                 "instead of an in-process batcher")
    h.add_argument("--label", default="server", help="--url: the endpoint's name in the table")
    h.add_argument("--model", help="--url: model id to request (default: the first of /v1/models)")
    h.add_argument("--timeout", type=float, default=600.0, help="--url: seconds per request")
    p.add_argument("--engines", default="", help="comma list of engine folders, one drafter each (ort)")
    p.add_argument("--backend", default="auto", choices=["auto", "ort", "torch"],
                   help="auto: ort with --engines, torch otherwise")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the backend's choice)")
    p.add_argument("--target", help="torch: HF folder or .gguf (default: the embedded default)")
    p.add_argument("--drafters", default="", help="torch: comma list KIND=PATH (default: the shipped drafters)")
    p.add_argument("--tree-top-k", type=int, default=None, help="EAGLE-3 tree: children per node (default: the engine folder's record, else DraftOptions')")
    p.add_argument("--tree-depth", type=int, default=None)
    p.add_argument("--tree-tokens", type=int, default=None)
    p.add_argument("--confidence-threshold", type=float, default=None, help="DSpark in the fixed mode")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma list of concurrent clients")
    p.add_argument("--requests", type=int, default=0, help="requests per run (default: 2 x concurrency, >= 4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", default="mtbench", choices=["mtbench", "synthetic"],
                   help="MT-bench first turns (chat template), or random token ids of --prompt-len")
    p.add_argument("--prompt-len", type=int, default=32, help="synthetic prompt length")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked against plain)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of plain, fixed, scheduled")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration (spread reported)")
    from specrt.tools.cli_serve import add_shared_batches_argument

    add_shared_batches_argument(p)
    p.add_argument("--sps", help="SPS table for the scheduled mode (default: each folder's sps.json / a quick profile)")
    p.add_argument("--out", type=Path, default=Path("runs/bench-serving"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lookup-alone", action="store_true",
                   help="also serve the drafter-free lookup proposer (copies from the text) on the first "
                        "folder's target: it needs no drafter, so a target-only folder works")
    p.add_argument("--lookup", type=int, default=None, help="copied drafts per step (default: the folder's / 16)")


def make_prompts(args, tokenizer, vocab: int, count: int) -> list[list[int]]:
    import torch

    if args.prompts == "mtbench":
        from specrt.tools.datasets import mtbench_questions

        questions = mtbench_questions()
        return [tokenizer.encode_chat(questions[i % len(questions)]["turns"][0]) for i in range(count)]
    g = torch.Generator().manual_seed(args.seed)
    return [torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(count)]


def build(args: argparse.Namespace):
    """(plain pipeline, {drafter: pipeline}, backend, {drafter: engine folder}); flags as `specrt bench`."""
    from specrt.plugins.errors import SpecrtError
    from specrt.tools.bench import build_pipelines, draft_options

    backend = args.backend if args.backend != "auto" else ("ort" if args.engines else "torch")
    if backend != "ort" and [m for m in args.modes.split(",") if m] == ["plain"]:
        from specrt.runtime.pipeline import Pipeline

        return Pipeline.from_checkpoint(args.target, device=args.device), {}, backend, {}
    if backend != "ort":
        plains, drafted, backend = build_pipelines(args)
        if args.lookup_alone:
            from specrt.runtime.proposers.factory import lookup_proposer

            drafted["lookup"] = plains["plain"].with_proposer(lookup_proposer(lookup_options(args, None)))
        return plains["plain"], drafted, backend, {}
    from specrt.export.manifest import load_manifest
    from specrt.export.draft_options import from_manifest
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.serving.loading import serving_pipeline

    folders = [f for f in args.engines.split(",") if f]
    if not folders:
        raise SpecrtError("--backend ort needs --engines FOLDER[,FOLDER...]",
                          "export engines first: specrt export --drafter KIND --out engines/NAME")
    plain, drafted, where = None, {}, {}
    for folder in folders:
        defaults = from_manifest(load_manifest(folder, verify_checksums=False).data)
        pipe = serving_pipeline(Pipeline.from_engines(folder, args.device, args.threads,
                                                      draft_options=draft_options(args, defaults)))
        if pipe.proposer is not None:
            if pipe.proposer.name in drafted:
                raise SpecrtError(f"two engine folders hold a {pipe.proposer.name} drafter", "pass one folder per drafter")
            drafted[pipe.proposer.name], where[pipe.proposer.name] = pipe, folder
        plain = plain or pipe.with_proposer(None)
    if args.lookup_alone:
        drafted["lookup"] = Pipeline.from_engines(folders[0], args.device, args.threads, drafter="lookup",
                                                  draft_options=lookup_options(args, folders[0]), measured=False)
        where["lookup"] = folders[0]
    from specrt.runtime.serving.loading import set_batch_mode

    for pipe in [plain, *drafted.values()]:
        set_batch_mode(pipe, args.shared_batches)
    return plain, drafted, "ort", where


def lookup_options(args: argparse.Namespace, folder: str | None):
    """DraftOptions of the drafter-free lookup proposer: the folder's defaults and --lookup N (its
    lookup.json is read by the folder's own proposer builder, `OrtEngines.proposer`)."""
    import dataclasses

    from specrt.export.manifest import load_manifest
    from specrt.export.draft_options import from_manifest
    from specrt.export.draft_options import DraftOptions
    from specrt.export.draft_options import DEFAULT_LOOKUP_TOKENS

    base = from_manifest(load_manifest(folder, verify_checksums=False).data) if folder else DraftOptions()
    return dataclasses.replace(base, lookup=args.lookup or base.lookup or DEFAULT_LOOKUP_TOKENS)


def closed_loop(batcher, prompts: list[list[int]], concurrency: int, max_new: int, sampling, ignore_eos: bool):
    """Keep `concurrency` requests in flight until all prompts are served; returns (requests, seconds)."""
    from specrt.runtime.serving.batcher import Request

    pending = list(enumerate(prompts))
    done: list = []
    requests = [None] * len(prompts)
    start = time.perf_counter()

    def submit() -> None:
        i, prompt = pending.pop(0)
        req = Request(prompt, max_new, sampling, ignore_eos=ignore_eos, on_finish=done.append)
        requests[i] = batcher.add(req)

    for _ in range(min(concurrency, len(pending))):
        submit()
    while not batcher.idle:
        batcher.step()
        while done and pending:
            done.pop()
            submit()
        done.clear()
    return requests, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return 0.0
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def run_config(pipe, proposer, schedule, sps, concurrency, prompts, args, sampling) -> dict:
    from specrt.runtime.serving.batcher import Batcher
    from specrt.runtime.serving.loading import eos_ids

    capacity = max(len(p) for p in prompts) + args.max_new_tokens + 1
    engine = pipe.engine_for(capacity, concurrency)
    batcher = Batcher(engine, proposer, schedule, sps, eos_ids(pipe))
    requests, seconds = closed_loop(batcher, prompts, concurrency, args.max_new_tokens, sampling, args.ignore_eos)
    tokens = sum(len(r.tokens) for r in requests)
    c = batcher.counters
    latency = [r.finished_at - r.submitted_at for r in requests]
    ttft = [r.first_token_at - r.submitted_at for r in requests]
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "tau": c.emitted / c.row_steps if c.row_steps else 1.0,
            "latency_p50": percentile(latency, 0.5), "latency_p90": percentile(latency, 0.9),
            "ttft_p50": percentile(ttft, 0.5), "steps": c.steps, "draft_steps": c.draft_steps,
            "copy_steps": c.copy_steps, "measured_plain_steps": c.measured_plain_steps,
            "outputs": [r.tokens for r in requests]}


def run(args: argparse.Namespace) -> int:
    import torch
    from specrt.plugins.errors import SpecrtError
    from specrt.runtime.backends.ort_session import default_threads
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.serving.calibrate import load_sps_for, profile_sps

    if args.url:
        from specrt.tools.bench_http import run_url

        return run_url(args)
    from specrt.tools.bench_http import parse_list

    levels = parse_list(args.concurrency, "concurrency")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise SpecrtError(f"--modes {args.modes!r}: use a comma list of {', '.join(MODES)}", "e.g. --modes plain,scheduled")
    if args.repeats < 1 or args.max_new_tokens < 1:
        raise SpecrtError("--repeats and --max-new-tokens must be >= 1", "e.g. --repeats 3 --max-new-tokens 128")
    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = SamplingParams(args.temperature, seed=args.seed)
    plain, drafted, backend, folders = build(args)
    if plain.host_threads is not None:
        # the batcher does torch host work between ORT calls: one thread (runtime/host_threads.py)
        torch.set_num_threads(plain.host_threads)
    if not drafted and modes != ["plain"]:
        raise SpecrtError("no drafter to compare with plain decoding",
                          "pass --engines folders with drafters, or --drafters KIND=PATH (torch)")
    n_requests = max(args.requests or 0, 0)
    tables = {}  # (drafter, concurrency) -> SPS table of the engine that level runs on

    def sps_table(name: str, pipe, c: int):
        """The folder's sps.json (or --sps) when it was profiled with c slots, else a quick profile of
        the very engine this level runs (c rows): a table from another slot count describes other
        graphs (batch 1 runs the ORT-fused graph, batches the portable one) and misleads the scheduler."""
        if (name, c) in tables:
            return tables[(name, c)]
        table = load_sps_for(folders.get(name), args.sps)
        if table is None or (not args.sps and int(table.meta.get("slots", -1)) != c):
            print(f"{name}: profiling a quick SPS table for {c} slot(s)", file=sys.stderr)
            engine = pipe.engine_for(min(pipe.config.max_position_embeddings,
                                         64 + (pipe.proposer.max_drafts + 1) + 1), c)
            engine.set_taps(pipe.proposer.tap_layers)
            table = profile_sps(engine, c * (pipe.proposer.max_drafts + 1), context=64, repeats=3, warmup=1)
        tables[(name, c)] = table
        return table

    results: list[dict] = []
    for c in levels:
        count = n_requests or max(4, 2 * c)
        prompts = make_prompts(args, plain.tokenizer, plain.config.vocab_size, count)
        configs = []
        if "plain" in modes:
            configs.append(("plain", "plain", plain, None, "fixed"))
        for name, pipe in drafted.items():
            if "fixed" in modes:
                configs.append((name, "fixed", pipe, pipe.proposer, "fixed"))
            if "scheduled" in modes:
                configs.append((name, "scheduled", pipe, pipe.proposer, "confidence"))
        runs: dict[tuple, list[dict]] = {(n, m): [] for n, m, *_ in configs}
        for rep in range(args.repeats):
            order = configs if rep % 2 == 0 else configs[::-1]  # interleaved: noise hits all alike
            for name, mode, pipe, proposer, schedule in order:
                table = sps_table(name, pipe, c) if mode == "scheduled" else None
                r = run_config(pipe, proposer, schedule, table, c, prompts, args, sampling)
                runs[(name, mode)].append(r)
                print(f"c={c:3d} {name:7s} {mode:9s} {r['tok_s']:8.1f} tok/s  tau {r['tau']:.2f}  "
                      f"p50 {r['latency_p50']:.2f}s", file=sys.stderr)
        reference = runs.get(("plain", "plain"), [None])[0]
        for (name, mode), rs in runs.items():
            rates = [r["tok_s"] for r in rs]
            same = None
            if reference is not None and sampling.greedy:
                same = sum(a == b for a, b in zip(rs[0]["outputs"], reference["outputs"])) / len(prompts)
            results.append({"drafter": name, "mode": mode, "concurrency": c, "requests": count,
                            "tok_s": statistics.mean(rates), "tok_s_min": min(rates), "tok_s_max": max(rates),
                            "tau": statistics.mean(r["tau"] for r in rs),
                            "latency_p50": statistics.mean(r["latency_p50"] for r in rs),
                            "latency_p90": statistics.mean(r["latency_p90"] for r in rs),
                            "ttft_p50": statistics.mean(r["ttft_p50"] for r in rs),
                            "draft_steps": rs[0]["draft_steps"], "copy_steps": rs[0].get("copy_steps", 0),
                            "measured_plain_steps": rs[0].get("measured_plain_steps", 0),
                            "steps": rs[0]["steps"], "same_as_plain": same})
    for row in results:
        base = next((r for r in results if r["mode"] == "plain" and r["concurrency"] == row["concurrency"]), None)
        row["speedup"] = row["tok_s"] / base["tok_s"] if base else None
    # the engine's compute threads (ORT's intra-op pool, or torch's); torch's own count is one here on ORT
    threads = args.threads or (default_threads() if backend == "ort" else torch.get_num_threads())
    report = {"backend": backend, "device": args.device, "threads": threads, "target": plain.name,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "prompts": args.prompts,
              "repeats": args.repeats, "results": results}
    from specrt.tools.report_files import write_report

    write_report(args.out, "serving", report, render_markdown(report), plot)
    return 0


def render_markdown(report: dict) -> str:
    lines = [f"## Serving: {report['target']} ({report['backend']}, {report['device']}, {report['threads']} threads)",
             "", (f"{report['max_new_tokens']} new tokens per request, temperature {report['temperature']}, "
                  f"{report['prompts']} prompts, {report['repeats']} run(s) per configuration "
                  "(tok/s: mean, spread min..max)."), "",
             ("| drafter | mode | concurrency | requests | tok/s | spread | vs plain | tau | latency p50 s | "
              "latency p90 s | TTFT p50 s | draft steps | copy-only steps | measured-plain steps | same as plain |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        same = "-" if r["same_as_plain"] is None else f"{100 * r['same_as_plain']:.0f}%"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['drafter']} | {r['mode']} | {r['concurrency']} | {r['requests']} | {r['tok_s']:.1f} | "
                     f"{r['tok_s_min']:.1f}..{r['tok_s_max']:.1f} | {speed} | {r['tau']:.2f} | "
                     f"{r['latency_p50']:.2f} | {r['latency_p90']:.2f} | {r['ttft_p50']:.3f} | "
                     f"{r['draft_steps']}/{r['steps']} | {r.get('copy_steps', 0)} | "
                     f"{r.get('measured_plain_steps', 0)} | {same} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[dict]] = {}
    for r in report["results"]:
        label = "plain" if r["mode"] == "plain" else f"{r['drafter']} {r['mode']}"
        series.setdefault(label, []).append(r)
    for label, rows in series.items():
        rows = sorted(rows, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        style = {"linestyle": "--", "color": "black"} if label == "plain" else {"linestyle": "-"}
        ax1.plot(xs, [r["tok_s"] for r in rows], marker="o", label=label, **style)
        ax1.fill_between(xs, [r["tok_s_min"] for r in rows], [r["tok_s_max"] for r in rows], alpha=0.15)
        ax2.plot(xs, [r["latency_p50"] for r in rows], marker="o", label=label, **style)
    for ax, ylabel in ((ax1, "throughput (tokens/s)"), (ax2, "request latency p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"serving {report['target']} ({report['backend']}, {report['device']}, {report['threads']} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from specrt.plugins.errors import run_reporting_errors

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    return run_reporting_errors("bench_serving", lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
