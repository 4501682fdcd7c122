"""Coupled against greedy drafts for seeded sampling: what drafting on the verification's noise buys.

    python -m specrt.tools.bench_coupled --engines engines/int4-eagle3,engines/int4-dflash,engines/int4-dspark \
        --temperatures 1.0,0.7 --out docs/results/coupled-drafts

A seeded request is verified on Gumbel-perturbed scores (`specrt.runtime.seeded`); a drafter that
`couples_noise` drafts on the same noise, one that does not drafts its argmax. For each folder's
drafter (copies off, chains of at most --max-drafts, every drafted token verified) and temperature,
every prompt (MT-bench first turns, then HumanEval prompts) runs both ways in turn, with seed n for
prompt n, next to plain decoding: accepted drafts per round, tau, tok/s and whether the text equals
plain decoding's at that seed. Writes bench.md, bench.json and bench.png under --out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from specrt.tools.report_files import write_report

WAYS = ("coupled", "greedy drafts")


def prompt_texts(mtbench: int, code: int) -> list[str]:
    from specrt.tools.datasets import code_prompts, mtbench_questions

    return [q["turns"][0] for q in mtbench_questions()[:mtbench]] + code_prompts()[:code]


def measure(folders: list[str], temperatures: list[float], texts: list[str], max_new: int, max_drafts: int,
            threads: int, progress=print) -> list[dict]:
    from specrt.export.draft_options import DraftOptions
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.sampling import SamplingParams

    options = DraftOptions(lookup=0, max_drafts=max_drafts, tree_top_k=1, tree_depth=max_drafts,
                           tree_tokens=max_drafts + 1, confidence_threshold=0.0)
    rows = []
    for folder in folders:
        drafted = Pipeline.from_engines(folder, threads=threads, draft_options=options)
        proposer = getattr(drafted.proposer, "inner", drafted.proposer)
        if proposer is None or not getattr(proposer, "couples_noise", False):
            raise SystemExit(f"{folder}: no drafter that drafts on the noise (export one with --drafter KIND)")
        plain = drafted.with_proposer(None)
        with_drafter = drafted.with_proposer(proposer)
        # the drafter's own setting, switched per run (an instance attribute over the class's)
        for temperature in temperatures:
            runs = {way: [] for way in WAYS}
            for n, text in enumerate(texts):
                ids = plain.encode(text)
                sampling = SamplingParams(temperature, seed=n)
                reference = plain.generate_ids([ids], max_new, sampling).tokens[0]
                for way in WAYS:
                    proposer.couples_noise = way == "coupled"
                    start = time.perf_counter()
                    out = with_drafter.generate_ids([ids], max_new, sampling)
                    seconds = time.perf_counter() - start
                    stats = out.stats[0]
                    made = len(out.tokens[0])
                    runs[way].append({"accepted_per_round": (made - stats.rounds) / stats.rounds,
                                      "tau": made / stats.rounds, "tok_s": made / seconds,
                                      "identical": out.tokens[0] == reference})
                progress(f"{Path(folder).name} T={temperature:g}: prompt {n + 1}/{len(texts)}")
            proposer.couples_noise = True
            for way in WAYS:
                r = runs[way]
                rows.append({"folder": Path(folder).name, "drafter": proposer.name, "temperature": temperature,
                             "way": way, "prompts": len(r),
                             "accepted_per_round": statistics.mean(x["accepted_per_round"] for x in r),
                             "tau": statistics.mean(x["tau"] for x in r),
                             "tok_s": statistics.median(x["tok_s"] for x in r),
                             "identical": sum(x["identical"] for x in r)})
    return rows


def render(rows: list[dict], args) -> str:
    lines = [f"Seeded sampling, chains of at most {args.max_drafts} drafts, copies off, {args.mtbench} MT-bench + "
             f"{args.code} HumanEval prompts x {args.max_new_tokens} tokens, {args.threads} threads; means over prompts "
             "(tok/s: median)", "",
             "| drafter | T | drafts | accepted drafts / round | tau | tok/s | same text as plain |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['drafter']} ({r['folder']}) | {r['temperature']:g} | {r['way']} | "
                     f"{r['accepted_per_round']:.3f} | {r['tau']:.2f} | {r['tok_s']:.1f} | {r['identical']}/{r['prompts']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    groups = sorted({(r["drafter"], r["temperature"]) for r in rows}, key=lambda g: (g[0], -g[1]))
    fig, ax = plt.subplots(figsize=(1.4 * len(groups) + 2, 3.2))
    width = 0.38
    for i, way in enumerate(WAYS):
        values = [next(r["accepted_per_round"] for r in rows if (r["drafter"], r["temperature"]) == g and r["way"] == way)
                  for g in groups]
        ax.bar([x + (i - 0.5) * width for x in range(len(groups))], values, width, label=way)
    ax.set_xticks(range(len(groups)), [f"{d}\nT={t:g}" for d, t in groups])
    ax.set_ylabel("accepted drafts per round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", required=True, help="comma list of engine folders with drafters")
    p.add_argument("--temperatures", default="1.0,0.7")
    p.add_argument("--mtbench", type=int, default=4, help="MT-bench first turns")
    p.add_argument("--code", type=int, default=2, help="HumanEval prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-drafts", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="folder for bench.md / bench.json / bench.png")
    args = p.parse_args(argv)
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    if not temperatures or min(temperatures) <= 0:
        raise SystemExit("--temperatures: give temperatures > 0 (coupling is for sampled, seeded requests)")
    rows = measure([f for f in args.engines.split(",") if f], temperatures, prompt_texts(args.mtbench, args.code),
                   args.max_new_tokens, args.max_drafts, args.threads)
    table = render(rows, args)
    if args.out:
        write_report(Path(args.out), "bench", {"settings": vars(args), "rows": rows}, table, plot)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
