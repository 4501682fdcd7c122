"""Acceptance and speed report on MT-bench first turns: `specrt bench` (torch backend for now).

    specrt bench --backend torch [--drafters eagle3=PATH,dflash=PATH,dspark=PATH] [--prompts 80]
                 [--max-new-tokens 256] [--speed-prompts 8] [--out docs/bench]

Two measurements, because they answer different questions on a 2-core machine:
- acceptance (tau, acceptance per draft position) on all prompts, greedy and T=1, generated as
  one batch per configuration: tau does not depend on batching, and batching makes 80 x 256 tokens
  affordable. In greedy mode every drafter's output is also compared with plain decoding (the
  first 64 tokens of each prompt, or all of them with --check-tokens).
- speed: batch-1 tokens/s of plain decoding and of each drafter on the first --speed-prompts
  prompts, configurations interleaved prompt by prompt so machine noise hits all of them alike;
  speedup = drafter tok/s / plain tok/s from the same run.
Writes a markdown report and two plots (acceptance per position, speedup) to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="torch", choices=["torch"])
    p.add_argument("--target", help="HF folder or .gguf (default: the embedded default)")
    p.add_argument("--drafters", default="", help="comma list KIND=PATH (default: the shipped drafters)")
    p.add_argument("--prompts", type=int, default=80, help="MT-bench first turns to use (max 80)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--check-tokens", type=int, default=64, help="greedy tokens compared with plain decoding")
    p.add_argument("--speed-prompts", type=int, default=8, help="prompts timed at batch 1 (0: skip)")
    p.add_argument("--speed-tokens", type=int, default=128)
    p.add_argument("--modes", default="greedy,t1", help="greedy and/or t1 (temperature 1)")
    p.add_argument("--batch-size", type=int, default=40, help="rows per batch in the acceptance runs")
    p.add_argument("--tree-top-k", type=int, default=4)
    p.add_argument("--tree-depth", type=int, default=5)
    p.add_argument("--tree-tokens", type=int, default=16)
    p.add_argument("--confidence-threshold", type=float, default=0.1)
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--seed", type=int, default=0)


def parse_drafters(text: str) -> dict[str, str | None]:
    from specrt.export.errors import SpecrtError
    from specrt.runtime.proposers.factory import DRAFTER_KINDS

    if not text:
        return {kind: None for kind in DRAFTER_KINDS}
    out: dict[str, str | None] = {}
    for item in text.split(","):
        kind, _, path = item.partition("=")
        if kind not in DRAFTER_KINDS:
            raise SpecrtError(f"--drafters: unknown kind {kind!r}", f"use KIND=PATH with KIND in {DRAFTER_KINDS}")
        out[kind] = path or None
    return out


def _batched(fn, prompts, batch_size):
    tokens, stats = [], []
    for i in range(0, len(prompts), batch_size):
        result = fn(prompts[i:i + batch_size])
        tokens += result.tokens
        stats += result.stats
    return tokens, stats


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from specrt.export.checkpoints import load_target
    from specrt.runtime.backends.torch_backend import TorchTargetEngine
    from specrt.runtime.generate import generate_autoregressive
    from specrt.runtime.proposers.factory import DraftOptions, load_proposer
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import generate_speculative
    from specrt.tools.datasets import mtbench_questions

    options = DraftOptions(args.tree_top_k, args.tree_depth, args.tree_tokens, args.confidence_threshold)
    target = load_target(args.target)
    model, tok = target.model, target.tokenizer
    eos = model.config.eos_token_ids
    shipped_for = target.name if args.target is None else None
    proposers = {kind: load_proposer(kind, path, model, options, shipped_for)
                 for kind, path in parse_drafters(args.drafters).items()}
    questions = mtbench_questions()[: args.prompts]
    prompts = [tok.encode_chat(q["turns"][0]) for q in questions]
    capacity = max(map(len, prompts)) + args.max_new_tokens + 8
    spare = max([64] + [p.max_drafts + 1 for p in proposers.values()])
    modes = {"greedy": SamplingParams(0.0), "t1": SamplingParams(1.0, seed=args.seed)}
    report: dict = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                    "acceptance": {}, "speed": {}, "lossless": {}}

    for mode in [m for m in args.modes.split(",") if m]:
        params = modes[mode]
        report["acceptance"][mode] = {}
        plain_tokens = None
        if mode == "greedy":
            bar = tqdm(total=len(prompts), desc=f"{mode}: plain", file=sys.stderr)

            def plain(batch):
                r = generate_autoregressive(TorchTargetEngine(model, capacity, len(batch), spare_slots=spare),
                                            batch, args.max_new_tokens, params, eos)
                bar.update(len(batch))
                return r

            plain_tokens, _ = _batched(plain, prompts, args.batch_size)
            bar.close()
        for kind, proposer in proposers.items():
            bar = tqdm(total=len(prompts), desc=f"{mode}: {kind}", file=sys.stderr)

            def spec(batch):
                r = generate_speculative(TorchTargetEngine(model, capacity, len(batch), spare_slots=spare), proposer,
                                         batch, args.max_new_tokens, params, eos)
                bar.update(len(batch))
                return r

            tokens, stats = _batched(spec, prompts, args.batch_size)
            bar.close()
            rounds = sum(s.rounds for s in stats)
            proposed = [sum(col) for col in _columns([s.proposed_per_position for s in stats])]
            accepted = [sum(col) for col in _columns([s.accepted_per_position for s in stats])]
            report["acceptance"][mode][kind] = {
                "tau": sum(s.round_tokens for s in stats) / max(rounds, 1),
                "acceptance_per_position": [a / p if p else 0.0 for a, p in zip(accepted, proposed)],
                "tokens": sum(s.new_tokens for s in stats), "rounds": rounds,
            }
            if plain_tokens is not None:
                n = args.check_tokens
                same = sum(a[:n] == b[:n] for a, b in zip(tokens, plain_tokens))
                report["lossless"][kind] = {"identical": same, "of": len(prompts), "tokens_compared": n}

    if args.speed_prompts:
        params = SamplingParams(0.0)
        names = ["plain"] + list(proposers)
        seconds = dict.fromkeys(names, 0.0)
        produced = dict.fromkeys(names, 0)
        speed_prompts = prompts[: args.speed_prompts]
        engine = TorchTargetEngine(model, max(map(len, speed_prompts)) + args.speed_tokens + 8, 1, spare_slots=spare)
        for i, prompt in enumerate(tqdm(speed_prompts, desc="speed (batch 1)", file=sys.stderr)):
            order = names if i % 2 == 0 else list(reversed(names))
            for name in order:
                start = time.perf_counter()
                if name == "plain":
                    r = generate_autoregressive(engine, [prompt], args.speed_tokens, params, eos)
                else:
                    r = generate_speculative(engine, proposers[name], [prompt], args.speed_tokens, params, eos)
                seconds[name] += time.perf_counter() - start
                produced[name] += r.stats[0].new_tokens
        base = produced["plain"] / seconds["plain"]
        for name in names:
            rate = produced[name] / seconds[name]
            report["speed"][name] = {"tok_s": rate, "speedup": rate / base}

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2))
    text = render_markdown(report)
    (args.out / "bench.md").write_text(text)
    plot(report, args.out)
    print(text)
    return 0


def _columns(rows: list[list[int]]) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0)
    return [[r[i] if i < len(r) else 0 for r in rows] for i in range(width)]


def render_markdown(report: dict) -> str:
    lines = [f"MT-bench first turns: {report['prompts']} prompts, max {report['max_new_tokens']} new tokens, "
             f"torch backend, {report['threads']} threads", ""]
    for mode, per_kind in report["acceptance"].items():
        lines += [f"### {mode}", "", "| drafter | tau | acceptance per draft position |", "|---|---|---|"]
        for kind, a in per_kind.items():
            rates = " ".join(f"{r:.2f}" for r in a["acceptance_per_position"])
            lines.append(f"| {kind} | {a['tau']:.2f} | {rates} |")
        lines.append("")
    if report["lossless"]:
        lines += ["### greedy output identical to plain decoding", "", "| drafter | identical |", "|---|---|"]
        for kind, c in report["lossless"].items():
            lines.append(f"| {kind} | {c['identical']}/{c['of']} (first {c['tokens_compared']} tokens) |")
        lines.append("")
    if report["speed"]:
        lines += ["### speed, batch 1, greedy", "", "| engine | tok/s | speedup |", "|---|---|---|"]
        for name, s in report["speed"].items():
            lines.append(f"| {name} | {s['tok_s']:.1f} | {s['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["acceptance"])
    if modes:
        fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            for kind, a in report["acceptance"][mode].items():
                rates = a["acceptance_per_position"]
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{kind} (tau {a['tau']:.2f})")
            ax.set(title=f"acceptance per draft position ({mode})", xlabel="draft position", ylabel="accepted fraction",
                   ylim=(0, 1))
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "acceptance.png", dpi=120)
        plt.close(fig)
    if report["speed"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        names = list(report["speed"])
        ax.bar(names, [report["speed"][n]["speedup"] for n in names])
        ax.axhline(1.0, color="gray", linestyle="--")
        ax.set(title="speedup over plain decoding (batch 1, greedy)", ylabel="x")
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
