"""The comparison table of `specrt bench --compare`: specrt's configurations beside the peers on two prompt
sets, in one interleaved run; median tokens/s and the ratio to a reference.

    specrt bench --engines engines/smollm2-int4,engines/smollm2-int4-eagle3 --compare ort-genai,llama.cpp \\
                 --speed-prompts 80 --speed-tokens 256 --threads 2 --modes "" --kv-contexts ""

Rows (W: a folder's weights, fp32 / int4 / w8a8 / gguf):
  specrt W plain               `--drafter none`, the first folder of each W
  specrt W copies alone        `--drafter lookup`, the first folder of each W
  specrt W auto                `--drafter auto` (the default), every folder: its drafter, if any, is one arm
  specrt W K + copies          `--drafter K` named, every folder with a drafter K
  the peers                    onnxruntime-genai int4 (fp32 with ort-genai-fp32), llama.cpp, specrt torch
Prompt sets: MT-bench first turns and HumanEval's code prompts (`specrt.tools.datasets`), the first
--speed-prompts of each, MT-bench first. Per prompt every row runs once, the order reversed every
other prompt so machine noise hits all rows alike; a row's tok/s on a prompt is new tokens / wall
seconds from prompt in to last token out (prefill included), greedy, the same token ids for all.
The table gives the median over the prompts and its ratio to the reference row (onnxruntime-genai
int4 when it ran, else the first specrt plain row). Every specrt row's text is compared with plain
decoding on the same weights (`identical`: prompts with the same tokens), and a named drafter counts
the prompts on which it ran slower than what the automatic choice measured (`slower`).
Writes compare.json, compare.md and compare.png (`report_files.write_report`).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REFERENCE_PEER = "ort-genai int4"


@dataclass
class Row:
    label: str
    # prompt ids -> (generated ids, or None for a peer; new tokens; wall seconds)
    run: Callable[[Sequence[int]], tuple[list[int] | None, int, float]]
    peer: bool = False
    plain: str | None = None  # the plain row on the same weights (specrt rows)
    note: Callable[[], str | None] | None = None  # a named drafter's slower-than-auto note of the last run
    detail: str = ""


@dataclass
class _Tally:
    rates: list[float] = field(default_factory=list)
    tokens: list[list[int] | None] = field(default_factory=list)
    slower: int = 0


def weights_name(manifest: dict) -> str:
    w = (manifest.get("export") or {}).get("weights") or {}
    bits = w.get("bits")
    if bits is None:
        return str((manifest.get("export") or {}).get("dtype", "float32")).replace("float", "fp")
    if w.get("weights") == "w8a8":
        return "w8a8"
    return "gguf" if bits == "gguf" else f"int{bits}"


def specrt_rows(folders: Sequence[str | Path], max_new: int, sampling, device: str = "cpu",
                threads: int | None = None, options_for: Callable[[dict], object] | None = None) -> list[Row]:
    """The specrt rows of the table for these engine folders (module docstring)."""
    from specrt.export.manifest import load_manifest
    from specrt.runtime.pipeline import Pipeline

    rows: list[Row] = []
    seen_weights: set[str] = set()
    for folder in folders:
        data = load_manifest(folder, verify_checksums=False).data
        weights = weights_name(data)
        options = options_for(data) if options_for else None
        plain_label = f"specrt {weights} plain"

        def pipe(drafter: str, folder=folder, options=options):
            # a named choice is measured against the automatic one in probe rounds (the `slower` count)
            return Pipeline.from_engines(folder, device, threads, drafter=drafter, draft_options=options,
                                         verify_checksums=False, compare_auto=drafter not in ("none", "auto"))

        if weights not in seen_weights:
            seen_weights.add(weights)
            rows.append(_specrt_row(plain_label, pipe("none"), max_new, sampling, None, Path(folder).name))
            rows.append(_specrt_row(f"specrt {weights} copies alone", pipe("lookup"), max_new, sampling,
                                    plain_label, Path(folder).name))
        kind = data.get("drafter", {}).get("kind") if data.get("drafter") else None
        auto = f"specrt {weights} auto" + (f" ({kind})" if kind else "")
        rows.append(_specrt_row(_unique(auto, rows, Path(folder).name), pipe("auto"), max_new, sampling, plain_label,
                                Path(folder).name))
        if kind:
            named = pipe(kind)
            label = named.proposer.name.replace("+lookup", " + copies")
            rows.append(_specrt_row(f"specrt {weights} {label}", named, max_new, sampling, plain_label,
                                    Path(folder).name))
    return rows


def _unique(label: str, rows: Sequence[Row], folder: str) -> str:
    return label if all(r.label != label for r in rows) else f"{label} [{folder}]"


def _specrt_row(label: str, pipe, max_new: int, sampling, plain: str | None, folder: str) -> Row:
    def run(prompt):
        start = time.perf_counter()
        result = pipe.generate_ids([list(prompt)], max_new, sampling)
        return result.tokens[0], result.stats[0].new_tokens, time.perf_counter() - start

    # a named choice measured against the automatic one (`AutoProposer.pinned`): its slower-than-auto note
    note = pipe.proposer.slower_note if getattr(pipe.proposer, "pinned", None) is not None else None
    return Row(label, run, plain=plain, note=note, detail=folder)


def peer_rows(peers) -> list[Row]:
    """Rows for `specrt.tools.peers.PeerRun`s that are installed (the others are listed as notes)."""
    from specrt.tools.peers import time_peer

    rows = []
    for peer in peers:
        if peer.generate is None:
            continue

        def run(prompt, peer=peer):
            made, seconds = time_peer(peer, prompt, run.max_new)
            return None, made, seconds

        rows.append(Row(peer.name, run, peer=True, detail=peer.note))
    return rows


def run_table(rows: Sequence[Row], prompt_sets: dict[str, list[list[int]]], max_new: int,
              progress: Callable[[str], None] | None = None) -> dict:
    """Time every row on every prompt of every set, interleaved; the report dict (module docstring)."""
    for row in rows:
        if row.peer:
            row.run.max_new = max_new  # type: ignore[attr-defined]
    first = next(iter(prompt_sets.values()))[0]
    for row in rows:  # warm-up: first-call allocations and lazy inits out of the timing
        row.run(first[:16])
    tallies = {name: {row.label: _Tally() for row in rows} for name in prompt_sets}
    for name, prompts in prompt_sets.items():
        for i, prompt in enumerate(prompts):
            if progress:
                progress(f"{name}: prompt {i + 1}/{len(prompts)}")
            for row in rows if i % 2 == 0 else list(reversed(rows)):
                tokens, made, seconds = row.run(prompt)
                tally = tallies[name][row.label]
                tally.rates.append(made / seconds if seconds > 0 else 0.0)
                tally.tokens.append(tokens)
                if row.note is not None and row.note():
                    tally.slower += 1
    labels = [row.label for row in rows]
    reference = REFERENCE_PEER if REFERENCE_PEER in labels else next(
        (r.label for r in rows if not r.peer and r.plain is None), labels[0])
    report: dict = {"reference": reference, "max_new_tokens": max_new,
                    "sets": {name: {"prompts": len(p)} for name, p in prompt_sets.items()}, "rows": {}}
    for row in rows:
        entry: dict = {"peer": row.peer, "detail": row.detail, "sets": {}}
        for name in prompt_sets:
            tally = tallies[name][row.label]
            ref = statistics.median(tallies[name][reference].rates)
            median = statistics.median(tally.rates)
            cell = {"median_tok_s": median, "ratio": median / ref if ref > 0 else None,
                    "tok_s_per_prompt": tally.rates}
            if row.plain is not None:
                plain = tallies[name][row.plain].tokens
                cell["identical"] = sum(a == b for a, b in zip(tally.tokens, plain))
                cell["of"] = len(plain)
            if row.note is not None:
                cell["slower"] = tally.slower
            entry["sets"][name] = cell
        report["rows"][row.label] = entry
    return report


SET_TITLES = {"mtbench": "MT-bench", "code": "code (HumanEval)"}


def render(report: dict) -> str:
    sets = list(report["sets"])
    ref = report["reference"]
    head = "| configuration |" + "".join(f" {SET_TITLES.get(s, s)} tok/s (median) | vs {ref} |" for s in sets)
    head += " greedy identical to plain |"
    lines = [" / ".join(f"{SET_TITLES.get(s, s)}: {report['sets'][s]['prompts']} prompts" for s in sets)
             + f", {report['max_new_tokens']} new tokens, batch 1, greedy, one interleaved run"
             + (f", {report['threads']} threads" if report.get("threads") else ""), "",
             head, "|---|" + "---|---|" * len(sets) + "---|"]
    notes = []
    for label, entry in report["rows"].items():
        cells = ""
        for s in sets:
            c = entry["sets"][s]
            ratio = f"{c['ratio']:.2f}x" if c["ratio"] is not None else "-"
            cells += f" {c['median_tok_s']:.1f} | {ratio} |"
        same = [entry["sets"][s] for s in sets if "identical" in entry["sets"][s]]
        identical = " / ".join(f"{c['identical']}/{c['of']}" for c in same) if same else "-"
        lines.append(f"| {label}{' (peer)' if entry['peer'] else ''} |{cells} {identical} |")
        slower = [entry["sets"][s].get("slower") for s in sets]
        if any(slower):
            notes.append(f"- {label}: slower than the automatic choice measured on "
                         + ", ".join(f"{n}/{report['sets'][s]['prompts']} {SET_TITLES.get(s, s)} prompts"
                                     for s, n in zip(sets, slower)))
        if entry["peer"] and entry["detail"]:
            notes.append(f"- {label}: {entry['detail']}")
    for name, note in report.get("missing_peers", {}).items():
        notes.append(f"- {name}: {note} (not run)")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(report["sets"])
    labels = list(report["rows"])
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 0.45 * len(labels) + 1.5), squeeze=False)
    for ax, s in zip(axes[0], sets):
        values = [report["rows"][label]["sets"][s]["median_tok_s"] for label in labels]
        colors = ["tab:gray" if report["rows"][label]["peer"] else "tab:blue" for label in labels]
        ax.barh(labels, values, color=colors)
        ref = report["rows"][report["reference"]]["sets"][s]["median_tok_s"]
        ax.axvline(ref, color="black", linestyle="--", linewidth=1)
        ax.set(title=f"{SET_TITLES.get(s, s)}: median tok/s", xlabel=f"tok/s (dashed: {report['reference']})")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out: Path, report: dict) -> list[Path]:
    from specrt.tools.report_files import write_report

    return write_report(out, "compare", report, render(report), plot)


def log(message: str) -> None:
    print(message, file=sys.stderr)
