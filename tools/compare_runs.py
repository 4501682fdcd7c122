"""Compare training runs by their held-out evaluations, step for step (a table and a plot).

    python -m specrt.tools.compare_runs --run "1 layer=runs/dflash" --run "2 layers=runs/dflash2l" \
        --out docs/training/dflash-depth.png

Every trainer appends its evaluations to `<run>/metrics.jsonl` (one JSON object per evaluation:
step, loss, acc per draft position, tau_est). Runs are compared at equal steps, which is what a
design choice (depth, block size) changes; their wall-clock times depend on what else shared the
machine, so they are left to the runs' summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from specrt.plugins.errors import SpecrtError, run_reporting_errors


def read_evaluations(run: Path) -> list[dict]:
    """The evaluations of a run folder, in step order."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise SpecrtError(f"{path} does not exist", "pass a run folder written by a specrt trainer (--out of the run)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SpecrtError(f"{path}:{number} is not JSON ({err.msg})", "remove the broken line or rerun") from None
        if "step" in row and "tau_est" in row:
            rows.append(row)
    if not rows:
        raise SpecrtError(f"{path} holds no evaluation", "let the run reach its first --eval-every step")
    return sorted(rows, key=lambda r: r["step"])


def parse_run(text: str) -> tuple[str, Path]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise SpecrtError(f"--run {text!r} is not NAME=FOLDER", 'write e.g. --run "2 layers=runs/dflash2l"')
    return name, Path(folder)


def table(runs: dict[str, list[dict]]) -> str:
    lines = ["| run | step | held-out loss | accuracy, draft 1 | tau_est |", "|---|---|---|---|---|"]
    for name, rows in runs.items():
        for r in rows:
            acc = r.get("acc") or [float("nan")]
            lines.append(f"| {name} | {r['step']} | {r['loss']:.3f} | {acc[0]:.3f} | {r['tau_est']:.3f} |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in runs.items():
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["loss"] for r in rows], marker="o", label=name)
        axes[1].plot(steps, [r["tau_est"] for r in rows], marker="o", label=name)
    for ax, label in zip(axes, ("held-out loss", "held-out tau_est")):
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specrt.tools.compare_runs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="NAME=FOLDER, repeated")
    ap.add_argument("--out", required=True, help="the plot (.png)")
    ap.add_argument("--title", default="held-out evaluations at equal steps")

    def run(args: argparse.Namespace) -> int:
        runs = {}
        for text in args.run:
            name, folder = parse_run(text)
            runs[name] = read_evaluations(folder)
        print(table(runs))
        plot(runs, Path(args.out), args.title)
        print(f"plot: {args.out}", file=sys.stderr)
        return 0

    args = ap.parse_args(argv)
    return run_reporting_errors("compare_runs", lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
