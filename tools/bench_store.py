"""How much a bigger copy datastore buys: copies from the text against the store's size, one run.

    python -m specrt.tools.bench_store --engines engines/smollm2-w8a8 --fractions 0,0.25,0.5,1 \\
        --prompts 20 --max-new-tokens 256 --threads 2 --out docs/results/copy-store-size-w8a8

Why. The copy proposer (`runtime/proposers/lookup.py`) drafts from the request's own text and from
a store of the target's greedy answers to other prompts (`runtime/proposers/datastore.py`, REST's
idea). Whether growing that store (generating more answers with `specrt train data`) is a way to the
speed bars is a question of how tau scales with its size; this measures it instead of guessing.

What. The store is rebuilt from the first fraction of the shipped data sets' answers (shuffled once,
seed 0, so a smaller store is a random subset of a larger one); fraction 0 is copies from the
request's own text alone. Every variant shares the loaded target and only swaps the store; plain
decoding of a target-only pipeline is the reference. Prompts are MT-bench first turns taken at an
even stride (every category), each decoded by every variant in turn so noise hits all alike.
Writes store.json, store.md (table) and store.png (tau and tok/s against the store's answers).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path

from specrt.tools.report_files import write_report


def parse_fractions(text: str) -> list[float]:
    from specrt.plugins.errors import SpecrtError

    try:
        fractions = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fractions = []
    if not fractions or any(not 0.0 <= f <= 1.0 for f in fractions):
        raise SpecrtError(f"--fractions {text!r}: give a comma list of numbers in [0, 1]", "e.g. --fractions 0,0.5,1")
    return sorted(set(fractions))


def stride_prompts(questions: list[dict], count: int) -> list[dict]:
    """`count` questions spread evenly over the list (MT-bench is ordered by category)."""
    count = max(1, min(count, len(questions)))
    step = len(questions) / count
    return [questions[int(i * step)] for i in range(count)]


def build_variants(args: argparse.Namespace):
    """(plain pipeline, [(label, answers in the store, pipeline)]) over one loaded target."""
    from specrt.plugins.errors import SpecrtError
    from specrt.export.manifest import load_manifest
    from specrt.runtime.backends.ort_backend import manifest_draft_defaults, with_folder_lookup
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.proposers.datastore import datastore_from_samples
    from specrt.runtime.proposers.factory import lookup_proposer
    from specrt.export.draft_options import DEFAULT_LOOKUP_TOKENS
    from specrt.tools.copy_files import read_data_sets, shipped_data_for

    data = load_manifest(args.engines, verify_checksums=False).data
    folders = [Path(f) for f in args.data.split(",") if f] if args.data else shipped_data_for(data["target"]["name"])
    if not folders:
        raise SpecrtError(f"no data set of {data['target']['name']}'s answers to build stores from",
                          "pass --data FOLDER built by `specrt train data` for this target")
    samples, source = read_data_sets(folders)
    random.Random(0).shuffle(samples)
    plain = Pipeline.from_engines(args.engines, threads=args.threads, drafter="none", verify_checksums=False)
    base = Pipeline.from_engines(args.engines, threads=args.threads, drafter="lookup", verify_checksums=False,
                                measured=False)
    defaults = manifest_draft_defaults(data)
    defaults = dataclasses.replace(defaults, lookup=args.lookup or defaults.lookup or DEFAULT_LOOKUP_TOKENS)
    variants = []
    for fraction in parse_fractions(args.fractions):
        count = round(len(samples) * fraction)
        store = datastore_from_samples(samples[:count], source) if count else False  # False: own text only
        options = with_folder_lookup(dataclasses.replace(defaults, lookup_datastore=store), base.folder,
                                     base.model, vocab_size=int(base.config.vocab_size))
        label = f"store {fraction:g} ({count} answers)" if count else "own text only"
        print(f"{label}: {len(store) if store else 0} n-grams", file=sys.stderr)
        variants.append((label, count, base.with_proposer(lookup_proposer(options))))
    # the text copies must reproduce: the folder's plain decoding as speculation runs it (two-row calls
    # on int8-activation engines); a target-only int4 folder exported before attention rows times
    # one-row calls, whose text may differ
    exact = getattr(base.model, "exact_decode", False) and not getattr(plain.model, "exact_decode", False)
    reference = base if exact else None
    return plain, variants, reference


def measure(plain, variants, prompts: list[str], max_new: int, reference=None) -> list[dict]:
    """tok/s and tau per variant; "same as plain" counts texts equal to `reference`'s plain decoding
    (default: the timed plain pipeline's)."""
    from tqdm import tqdm

    names = ["plain"] + [label for label, _, _ in variants]
    pipes = [plain] + [pipe for _, _, pipe in variants]
    totals = {n: {"tokens": 0, "rounds": 0, "seconds": 0.0, "same": 0} for n in names}
    plain.generate(prompts[0], max_new_tokens=8)  # warm the sessions
    for prompt in tqdm(prompts, desc="prompts", file=sys.stderr):
        expected = None if reference is None else reference.generate(prompt, max_new_tokens=max_new,
                                                                       speculative=False).text
        for name, pipe in zip(names, pipes):
            start = time.perf_counter()
            out = pipe.generate(prompt, max_new_tokens=max_new, speculative=name != "plain")
            t = totals[name]
            t["seconds"] += time.perf_counter() - start - out.stats.prefill_seconds
            t["tokens"] += out.stats.new_tokens
            t["rounds"] += out.stats.rounds
            expected = out.text if expected is None else expected
            t["same"] += out.text == expected
    rows = []
    answers = {label: count for label, count, _ in variants}
    base = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    for name in names:
        t = totals[name]
        tok_s = t["tokens"] / t["seconds"]
        tau = None if name == "plain" else t["tokens"] / max(t["rounds"], 1)
        rows.append({"variant": name, "answers": answers.get(name), "tau": tau,
                     "tok_s": tok_s, "vs_plain": tok_s / base, "same_as_plain": t["same"], "prompts": len(prompts)})
    return rows


def render(report: dict) -> str:
    lines = [f"## Copy datastore size: {report['engines']} ({report['threads']} threads)", "",
             (f"{report['prompts']} MT-bench first turns (even stride), {report['max_new_tokens']} new tokens, "
              "greedy, variants interleaved per prompt; plain is the target-only folder's decoding, \"same as "
              f"plain\" compares with {report.get('reference', 'the timed plain decoding')}."), "",
             "| variant | answers in the store | tau | tok/s | vs plain | same as plain |", "|---|---|---|---|---|---|"]
    for r in report["results"]:
        answers = "" if r["answers"] is None else str(r["answers"])
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(f"| {r['variant']} | {answers} | {tau} | {r['tok_s']:.1f} | {r['vs_plain']:.2f}x "
                     f"| {r['same_as_plain']}/{r['prompts']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["answers"] is not None]
    xs = [max(r["answers"], 1) for r in rows]  # own text only drawn at 1 on the log axis
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [r["tau"] for r in rows], "o-")
    a.set(xscale="log", xlabel="answers in the store (own text only at 1)", ylabel="tau", title="accepted per step")
    b.plot(xs, [r["vs_plain"] for r in rows], "o-")
    b.set(xscale="log", xlabel="answers in the store", ylabel="x plain decoding", title="speed vs plain")
    fig.suptitle(f"copies vs datastore size: {report['engines']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", required=True, help="an engine folder (any; its own store is not used)")
    p.add_argument("--fractions", default="0,0.25,0.5,1", help="store sizes as fractions of the data's answers")
    p.add_argument("--data", default="", help="data set folders (default: the shipped ones for this target)")
    p.add_argument("--prompts", type=int, default=20, help="MT-bench first turns, at an even stride")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--lookup", type=int, default=0, help="copy tokens per step (default: the folder's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("runs/bench-store"))
    args = p.parse_args(argv)
    from specrt.plugins.errors import SpecrtError
    from specrt.tools.datasets import mtbench_questions

    try:
        if args.prompts < 1 or args.max_new_tokens < 1:
            raise SpecrtError("--prompts and --max-new-tokens must be >= 1", "e.g. --prompts 20 --max-new-tokens 256")
        plain, variants, reference = build_variants(args)
        prompts = [q["turns"][0] for q in stride_prompts(mtbench_questions(), args.prompts)]
        results = measure(plain, variants, prompts, args.max_new_tokens, reference)
    except SpecrtError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = {"engines": str(args.engines), "threads": args.threads, "prompts": len(prompts),
              "reference": "two-row plain decoding" if reference is not None else "the timed plain decoding",
              "max_new_tokens": args.max_new_tokens, "results": results}
    write_report(args.out, "store", report, render(report), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
