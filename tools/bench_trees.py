"""EAGLE-3 draft shapes against plain decoding on one engine folder: which tree pays on this device.

    python -m specrt.tools.bench_trees --engines engines/smollm2-eagle3 --shapes 4/4/16,2/2/4,1/2/3

Shape = top_k/depth/verify tokens (anchor included; top_k 1 is a chain), optionally @threshold for a
chain that stops where the drafter's path probability drops below it (1/4/5@0.2). Every shape shares the
loaded target and drafter; prompts (MT-bench first turns) are decoded by plain decoding and each
shape in turn, interleaved, so noise hits all alike. Prints tok/s, the ratio to plain decoding, tau,
drafting ms per round, and whether each output equals plain decoding's.
"""

from __future__ import annotations

import argparse

from specrt.runtime.pipeline import Pipeline
from specrt.export.draft_options import DraftOptions
from specrt.runtime.proposers.factory import proposer_for


def parse_shapes(text: str) -> list[tuple[int, int, int, float]]:
    shapes = []
    for item in text.split(","):
        shape, _, threshold = item.partition("@")
        k, d, n = (int(x) for x in shape.split("/"))
        shapes.append((k, d, n, float(threshold or 0.0)))
    return shapes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", required=True, help="an engine folder with an EAGLE-3 drafter")
    p.add_argument("--shapes", default="4/4/16,3/3/8,2/3/6,2/2/4,1/3/4,1/2/3")
    p.add_argument("--prompts", type=int, default=6, help="MT-bench first turns")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    from specrt.tools.datasets import mtbench_questions

    pipe = Pipeline.from_engines(args.engines, threads=args.threads)
    drafting = getattr(pipe.proposer, "inner", pipe.proposer)  # the drafter without the folder's copies
    if drafting is None or drafting.name != "eagle3":
        raise SystemExit(f"{args.engines} holds no EAGLE-3 drafter")
    drafter = drafting.drafter  # shapes are timed for the drafter alone (no copies from the text)
    configs: dict[str, Pipeline] = {"plain": pipe}
    for k, d, n, threshold in parse_shapes(args.shapes):
        options = DraftOptions(tree_top_k=k, tree_depth=d, tree_tokens=n, confidence_threshold=threshold)
        label = f"{k}/{d}/{n}" + (f"@{threshold:g}" if threshold else "")
        configs[label] = pipe.with_proposer(proposer_for("eagle3", drafter, options))
    prompts = [q["turns"][0] for q in mtbench_questions()[: args.prompts]]
    for label, cfg in configs.items():  # warm-up
        cfg.generate(prompts[0], max_new_tokens=16, speculative=label != "plain")
    totals = {label: {"tokens": 0, "seconds": 0.0, "rounds": 0, "draft": 0.0, "same": 0} for label in configs}
    for prompt in prompts:
        reference = None
        for label, cfg in configs.items():
            g = cfg.generate(prompt, max_new_tokens=args.max_new_tokens, speculative=label != "plain")
            t = totals[label]
            t["tokens"] += len(g.tokens)
            t["seconds"] += g.seconds
            t["rounds"] += g.stats.rounds
            t["draft"] += g.stats.draft_seconds
            if label == "plain":
                reference = g.tokens
            t["same"] += int(g.tokens == reference)
    plain = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    print(f"{args.engines}: {len(prompts)} MT-bench prompts x {args.max_new_tokens} tokens, greedy, "
          f"{args.threads} threads\n")
    print("| shape (top_k/depth/tokens) | tok/s | vs plain | tau | draft ms/round | identical to plain |")
    print("|---|---|---|---|---|---|")
    for label, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        tau = t["tokens"] / t["rounds"] if t["rounds"] else 1.0
        draft = 1e3 * t["draft"] / t["rounds"] if t["rounds"] else 0.0
        print(f"| {label} | {rate:.1f} | {rate / plain:.2f}x | {tau:.2f} | {draft:.1f} | {t['same']}/{len(prompts)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
