"""What weight quantization costs in quality: quantized engines against the fp32 one.

    python -m specrt.tools.quant_report --engines engines/fp32,engines/int8,engines/int4 \\
        [--prompts 80] [--tokens 128] [--ppl-samples 48] [--threads 2] [--out docs/quant]

The first folder is the reference (fp32). For each other folder:
- greedy agreement on MT-bench first turns: the quantized target's greedy continuation against the
  reference's, token by token; reported: prompts identical over --tokens, and the mean / median
  index of the first diverging token (a prompt that never diverges counts as --tokens);
- perplexity of the target on held-out ShareGPT responses of the committed data set
  (tools/data/sharegpt-smollm2, the 5 % validation split of the trainers): teacher-forced NLL of the
  response tokens given prompt and earlier response, exp of the token-weighted mean;
- tau of the folder's drafter is not measured here: `specrt bench --engines` on the quantized folders
  gives it (speculation is lossless with respect to the quantized target, which it verifies against).
Writes quant.json, quant.md and a plot of the first-divergence distribution.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "sharegpt-smollm2"


def first_divergence(a: list[int], b: list[int], limit: int) -> int:
    """Index of the first differing token within `limit`; `limit` when the outputs agree throughout."""
    a, b = a[:limit], b[:limit]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return limit if len(a) == len(b) else min(len(a), len(b))  # one stopped (eos) where the other went on


def response_nll(pipe, prompt: list[int], response: list[int]) -> tuple[float, int]:
    """Sum of -log p(response token | everything before it) and the token count."""
    from specrt.runtime.engine import causal_mask

    ids = list(prompt) + list(response)
    engine = pipe.engine_for(len(ids) + 1)
    engine.set_taps(())
    engine.reset(1)
    t = len(ids)
    rows = torch.arange(len(prompt) - 1, t - 1)[None]  # the rows that predict the response tokens
    logits, _ = engine.forward(torch.tensor([ids]), torch.arange(t)[None], causal_mask(1, t), rows)
    logp = torch.log_softmax(logits[0].float(), dim=-1)
    target = torch.tensor(response)
    return float(-logp[torch.arange(len(response)), target].sum()), len(response)


def held_out(data: Path, count: int) -> list[dict]:
    from specrt.tools.build_data import read_shards
    from specrt.tools.train_features import is_validation

    samples = [s for s in read_shards(data) if is_validation(s["id"]) and s["response"]]
    return samples[:count]


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams
    from specrt.tools.datasets import mtbench_questions

    folders = [f for f in args.engines.split(",") if f]
    if len(folders) < 2:
        from specrt.plugins.errors import SpecrtError

        raise SpecrtError("--engines needs the reference folder and at least one quantized folder",
                          "pass --engines engines/fp32,engines/int4 (export with --weights int4)")
    pipes = {f: Pipeline.from_engines(f, threads=args.threads, drafter="none") for f in folders}
    weights = {f: _weights_label(f) for f in folders}
    tok = pipes[folders[0]].tokenizer
    prompts = [tok.encode_chat(q["turns"][0]) for q in mtbench_questions()[: args.prompts]]
    greedy = SamplingParams(0.0)
    outputs = {}
    for f, pipe in pipes.items():
        outputs[f] = []
        for i in tqdm(range(0, len(prompts), args.batch_size), desc=f"greedy {weights[f]}", file=sys.stderr):
            outputs[f] += pipe.generate_ids(prompts[i:i + args.batch_size], args.tokens, greedy).tokens
    samples = held_out(Path(args.data), args.ppl_samples)
    report: dict = {"prompts": len(prompts), "tokens": args.tokens, "ppl_samples": len(samples),
                    "reference": weights[folders[0]], "results": {}}
    for f, pipe in pipes.items():
        nll, count = 0.0, 0
        for s in tqdm(samples, desc=f"perplexity {weights[f]}", file=sys.stderr):
            a, n = response_nll(pipe, s["prompt"], s["response"])
            nll, count = nll + a, count + n
        entry = {"weights": weights[f], "folder": f, "perplexity": math.exp(nll / max(count, 1)),
                 "ppl_tokens": count}
        if f != folders[0]:
            div = [first_divergence(a, b, args.tokens) for a, b in zip(outputs[f], outputs[folders[0]])]
            entry.update(identical=sum(d >= args.tokens for d in div), first_divergence=div,
                         mean_first_divergence=statistics.mean(div), median_first_divergence=statistics.median(div))
        report["results"][weights[f]] = entry
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant.json").write_text(json.dumps(report, indent=2))
    text = render(report)
    (out / "quant.md").write_text(text)
    plot(report, out)
    print(text)
    return 0


def _weights_label(folder: str) -> str:
    from specrt.export.manifest import load_manifest

    w = (load_manifest(folder, verify_checksums=False).data.get("export") or {}).get("weights") or {}
    if w.get("weights") == "w8a8":
        return "w8a8 (int8 per column x int8 per token, integer MatMuls)"
    if w.get("bits") == "gguf":
        return f"gguf blocks (accuracy level {w.get('accuracy_level')})"
    if w.get("bits"):
        sym = "sym" if w.get("symmetric") else "asym"
        head = "" if w.get("lm_head") else ", fp32 head"
        return f"int{w['bits']} (block {w.get('block_size')}, {sym}{head})"
    return w.get("scheme", "float32")


def render(report: dict) -> str:
    lines = [f"Reference: {report['reference']}. Greedy agreement on {report['prompts']} MT-bench first turns over "
             f"{report['tokens']} tokens; perplexity on {report['ppl_samples']} held-out ShareGPT responses.", "",
             "| weights | perplexity | identical greedy outputs | mean first divergence | median |", "|---|---|---|---|---|"]
    for label, r in report["results"].items():
        if "identical" in r:
            lines.append(f"| {label} | {r['perplexity']:.3f} | {r['identical']}/{report['prompts']} | "
                         f"{r['mean_first_divergence']:.1f} | {r['median_first_divergence']:.0f} |")
        else:
            lines.append(f"| {label} (reference) | {r['perplexity']:.3f} | - | - | - |")
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, r in report["results"].items():
        if "first_divergence" in r:
            ax.hist(r["first_divergence"], bins=16, range=(0, report["tokens"]), alpha=0.6, label=label)
    ax.set(title="first token where greedy output leaves the reference's", xlabel="token index", ylabel="prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "first_divergence.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from specrt.plugins.errors import run_reporting_errors

    ap = argparse.ArgumentParser(prog="python -m specrt.tools.quant_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", required=True, help="reference folder first, then quantized folders")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ppl-samples", type=int, default=48)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="runs/quant")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return run_reporting_errors("quant_report", lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
