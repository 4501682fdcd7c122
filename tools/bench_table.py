"""The comparison table of `specrt bench --compare`: specrt's configurations beside the peers on two prompt
sets, in one interleaved run; median tokens/s and the ratio to a reference.

    specrt bench --engines engines/smollm2-int4,engines/smollm2-int4-eagle3 --compare ort-genai,llama.cpp \\
                 --speed-prompts 80 --speed-tokens 256 --threads 2 --modes "" --kv-contexts ""

Rows (W: a folder's weights, fp32 / int4 / w8a8 / gguf):
  specrt W plain               `--drafter none`, the first folder of each W
  specrt W plain, one-row steps `--drafter none --fast-plain`, where it differs (int8-activation weights:
                               one-row steps like the peers', whose text may round away from plain's)
  specrt W plain, second engine  with `twin_plain` (`specrt bench --plain-twin`): the plain row again, on an
                               engine of its own. Two engines of one folder in one process differ in speed
                               by several percent (up to 8% in one headline run here, the first loaded most often the slower), so
                               its ratio to plain decoding, prompt by prompt, is the noise floor that the
                               other rows' ratios are read against
  specrt W copies alone        `--drafter lookup`, the first folder of each W
  specrt W auto                `--drafter auto` (the default), every folder: its drafter, if any, is one arm
  specrt W K + copies          `--drafter K` named, every folder with a drafter K
  the peers                    onnxruntime-genai int4 (fp32 with ort-genai-fp32), llama.cpp, specrt torch
Prompt sets: MT-bench first turns and HumanEval's code prompts (`specrt.tools.datasets`), the first
--speed-prompts of each, MT-bench first. Per prompt every row runs once, the order reversed every
other prompt so machine noise hits all rows alike; a row's tok/s on a prompt is new tokens / wall
seconds from prompt in to last token out (prefill included), the same token ids for all.
The table gives the median over the prompts and its ratio to the reference row (onnxruntime-genai
int4 when it ran, else the first specrt plain row). Every specrt row's text is compared with plain
decoding on the same weights (`identical`: prompts with the same tokens), and a named drafter counts
the prompts on which it ran slower than what the automatic choice measured (`slower`).

Sampling (`run_table(sampling=...)`): greedy by default. At a temperature > 0 prompt n of the run
(the sets in order, counted from 0) is sampled with seed `sampling.seed + n` (0 + n without one) by
every row: specrt's seeded sampling makes a text depend only on prompt, settings and seed, whatever
was drafted (`specrt.runtime.seeded`), so `identical` still checks that drafting changed nothing. The peers
sample at the same temperature with their own random generators (seeded with the same number):
their texts are their own samples.

Where the time goes (`cost_split`), per specrt row and set, medians over the prompts of the
`RequestStats` of each request: tau (tokens per verify round, bonus included), drafting, verify and
host ms per verify round, prefill ms; and, for an `AutoProposer`, the rounds each arm ran.
Writes compare.json, compare.md and compare.png (`report_files.write_report`).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specrt.runtime.sampling import SamplingParams
from specrt.runtime.stats import RequestStats

REFERENCE_PEER = "ort-genai int4"
TWIN_SUFFIX = ", second engine"  # the plain row's label + this: the noise-floor row (`twin_plain`)
GREEDY = SamplingParams()


@dataclass
class RowRun:
    """One request of one row."""

    tokens: list[int] | None  # generated ids (None for a peer: its text is not compared)
    new_tokens: int
    seconds: float  # wall, prompt in to last token out
    stats: RequestStats | None = None  # specrt rows: where the time went
    arm_rounds: dict[str, int] | None = None  # `--drafter auto` and named choices: rounds per arm


@dataclass
class Row:
    label: str
    run: Callable[[Sequence[int], int, SamplingParams], RowRun]  # (prompt ids, max new tokens, sampling)
    peer: bool = False
    plain: str | None = None  # the plain row on the same weights (specrt rows)
    note: Callable[[], str | None] | None = None  # a named drafter's slower-than-auto note of the last run
    detail: str = ""


@dataclass
class _Tally:
    rates: list[float] = field(default_factory=list)
    tokens: list[list[int] | None] = field(default_factory=list)
    stats: list[RequestStats] = field(default_factory=list)
    arm_rounds: Counter = field(default_factory=Counter)
    slower: int = 0


def weights_name(manifest: dict) -> str:
    w = (manifest.get("export") or {}).get("weights") or {}
    bits = w.get("bits")
    if bits is None:
        return str((manifest.get("export") or {}).get("dtype", "float32")).replace("float", "fp")
    if w.get("weights") == "w8a8":
        return "w8a8"
    return "gguf" if bits == "gguf" else f"int{bits}"


def specrt_rows(folders: Sequence[str | Path], device: str = "cpu", threads: int | None = None,
                options_for: Callable[[str | Path], object] | None = None, twin_plain: bool = False) -> list[Row]:
    """The specrt rows of the table for these engine folders (module docstring); options_for(folder): the
    DraftOptions of a folder's pipelines (default: its record); twin_plain: a second plain engine per
    weights (the noise floor, module docstring)."""
    from specrt.export.manifest import load_manifest
    from specrt.runtime.pipeline import Pipeline

    rows: list[Row] = []
    seen_weights: set[str] = set()
    for folder in folders:
        data = load_manifest(folder, verify_checksums=False).data
        weights = weights_name(data)
        options = options_for(folder) if options_for else None
        plain_label = f"specrt {weights} plain"

        def pipe(drafter: str, folder=folder, options=options):
            # a named choice is measured against the automatic one in probe rounds (the `slower` count)
            return Pipeline.from_engines(folder, device, threads, drafter=drafter, draft_options=options,
                                         verify_checksums=False)

        if weights not in seen_weights:
            seen_weights.add(weights)
            plain = pipe("none")
            rows.append(_specrt_row(plain_label, plain, None, Path(folder).name))
            if getattr(plain.model, "attention_row_decode", False):  # `--fast-plain`: the peers' kind of step
                fast = Pipeline.from_engines(folder, device, threads, drafter="none", verify_checksums=False,
                                             exact_plain=False)
                rows.append(_specrt_row(f"specrt {weights} plain, one-row steps", fast, plain_label, Path(folder).name))
            rows.append(_specrt_row(f"specrt {weights} copies alone", pipe("lookup"), plain_label, Path(folder).name))
            if twin_plain:
                rows.append(_specrt_row(plain_label + TWIN_SUFFIX, pipe("none"), plain_label, Path(folder).name))
        kind = data.get("drafter", {}).get("kind") if data.get("drafter") else None
        auto = f"specrt {weights} auto" + (f" ({kind})" if kind else "")
        rows.append(_specrt_row(_unique(auto, rows, Path(folder).name), pipe("auto"), plain_label, Path(folder).name))
        if kind:
            named = pipe(kind)
            label = named.proposer.name.replace("+lookup", " + copies")
            rows.append(_specrt_row(f"specrt {weights} {label}", named, plain_label, Path(folder).name))
    return rows


def _unique(label: str, rows: Sequence[Row], folder: str) -> str:
    return label if all(r.label != label for r in rows) else f"{label} [{folder}]"


def _specrt_row(label: str, pipe, plain: str | None, folder: str) -> Row:
    def run(prompt, max_new, sampling):
        start = time.perf_counter()
        result = pipe.generate_ids([list(prompt)], max_new, sampling)
        seconds = time.perf_counter() - start
        stats = result.stats[0]
        return RowRun(result.tokens[0], stats.new_tokens, seconds, stats, arm_rounds(pipe.proposer))

    # a named choice measured against the automatic one (`AutoProposer.pinned`): its slower-than-auto note
    note = pipe.proposer.slower_note if getattr(pipe.proposer, "pinned", None) is not None else None
    return Row(label, run, plain=plain, note=note, detail=folder)


def arm_rounds(proposer) -> dict[str, int] | None:
    """Rounds per arm of the request just run, for an `AutoProposer` (None for other proposers). Its
    summary counts closed rounds: the last round of a request is not in it."""
    from specrt.runtime.proposers.auto import AutoProposer

    if not isinstance(proposer, AutoProposer):
        return None
    return {arm: int(s["rounds"]) for arm, s in proposer.summary().items()}


def peer_rows(peers) -> list[Row]:
    """Rows for `specrt.tools.peers.PeerRun`s that are installed (the others are listed as notes)."""
    from specrt.tools.peers import time_peer

    rows = []
    for peer in peers:
        if peer.generate is None:
            continue

        def run(prompt, max_new, sampling, peer=peer):
            if sampling.top_k or sampling.top_p < 1.0:
                raise ValueError("the peers sample with top-k and top-p off: pass a temperature alone")
            made, seconds = time_peer(peer, prompt, max_new, sampling.temperature, sampling.seed)
            return RowRun(None, made, seconds)

        rows.append(Row(peer.name, run, peer=True, detail=peer.note))
    return rows


def prompt_sampling(sampling: SamplingParams, number: int) -> SamplingParams:
    """What every row samples prompt `number` of the run with: greedy as given; else seeded with
    seed + number (module docstring)."""
    if sampling.greedy:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed or 0) + number)


def cost_split(stats: Sequence[RequestStats]) -> dict:
    """Medians over requests: tau, draft / verify / host ms per verify round and prefill ms. Requests
    that ended at prefill (no verify round) count for prefill only."""
    stepped = [s for s in stats if s.rounds]

    def median(values) -> float | None:
        values = list(values)
        return statistics.median(values) if values else None

    def per_round_ms(seconds_of) -> float | None:
        value = median(seconds_of(s) / s.rounds for s in stepped)
        return None if value is None else value * 1000.0

    prefill = median(s.prefill_seconds for s in stats)
    return {"tau": median(s.tau for s in stepped),
            "draft_ms_per_round": per_round_ms(lambda s: s.draft_seconds),
            "verify_ms_per_round": per_round_ms(lambda s: s.verify_seconds),
            "host_ms_per_round": per_round_ms(lambda s: s.host_seconds),
            "prefill_ms": None if prefill is None else prefill * 1000.0,
            "rounds": median(s.rounds for s in stats)}


def run_table(rows: Sequence[Row], prompt_sets: dict[str, list[list[int]]], max_new: int,
              sampling: SamplingParams = GREEDY, progress: Callable[[str], None] | None = None) -> dict:
    """Time every row on every prompt of every set, interleaved; the report dict (module docstring)."""
    first = next(iter(prompt_sets.values()))[0]
    for row in rows:  # warm-up: first-call allocations and lazy inits out of the timing
        row.run(first[:16], max_new, prompt_sampling(sampling, 0))
    tallies = {name: {row.label: _Tally() for row in rows} for name in prompt_sets}
    number = 0
    for name, prompts in prompt_sets.items():
        for i, prompt in enumerate(prompts):
            if progress:
                progress(f"{name}: prompt {i + 1}/{len(prompts)}")
            params = prompt_sampling(sampling, number)
            number += 1
            for row in rows if i % 2 == 0 else list(reversed(rows)):
                done = row.run(prompt, max_new, params)
                tally = tallies[name][row.label]
                tally.rates.append(done.new_tokens / done.seconds if done.seconds > 0 else 0.0)
                tally.tokens.append(done.tokens)
                if done.stats is not None:
                    tally.stats.append(done.stats)
                if done.arm_rounds:
                    tally.arm_rounds.update(done.arm_rounds)
                if row.note is not None and row.note():
                    tally.slower += 1
    labels = [row.label for row in rows]
    reference = REFERENCE_PEER if REFERENCE_PEER in labels else next(
        (r.label for r in rows if not r.peer and r.plain is None), labels[0])
    report: dict = {"reference": reference, "max_new_tokens": max_new,
                    "sampling": {"temperature": sampling.temperature,
                                 "seed": None if sampling.greedy else (sampling.seed or 0)},
                    "sets": {name: {"prompts": len(p)} for name, p in prompt_sets.items()}, "rows": {}}
    for row in rows:
        entry: dict = {"peer": row.peer, "detail": row.detail, "sets": {}}
        if row.plain is not None:
            entry["plain"] = row.plain  # the plain row on the same weights (`against_plain`)
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
            if tally.stats:
                cell["cost"] = cost_split(tally.stats)
            if tally.arm_rounds:
                cell["arm_rounds"] = dict(tally.arm_rounds)
            entry["sets"][name] = cell
        report["rows"][row.label] = entry
    return report


SET_TITLES = {"mtbench": "MT-bench", "code": "code (HumanEval)"}


def sampling_words(report: dict) -> str:
    """How the run sampled, for titles: "greedy" or the temperature and seeds."""
    sampling = report.get("sampling") or {}
    temperature = sampling.get("temperature", 0.0)
    if not temperature:
        return "greedy"
    return (f"sampled at temperature {temperature:g} (no top-k / top-p), prompt n with seed "
            f"{sampling.get('seed') or 0} + n in every row")


def render(report: dict) -> str:
    sets = list(report["sets"])
    ref = report["reference"]
    sampled = bool((report.get("sampling") or {}).get("temperature"))
    head = "| configuration |" + "".join(f" {SET_TITLES.get(s, s)} tok/s (median) | vs {ref} |" for s in sets)
    head += " same text as plain (same seed) |" if sampled else " greedy identical to plain |"
    lines = [" / ".join(f"{SET_TITLES.get(s, s)}: {report['sets'][s]['prompts']} prompts" for s in sets)
             + f", {report['max_new_tokens']} new tokens, batch 1, {sampling_words(report)}, one interleaved run"
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
    if sampled:
        temperature = report["sampling"]["temperature"]
        notes.append(f"- the peers sample at temperature {temperature:g} with their own random generators: their "
                     "texts are their own samples, not compared with specrt's")
    sections = render_against_plain(report) + render_costs(report)
    return "\n".join(lines + ([""] + notes if notes else []) + sections) + "\n"


def against_plain(report: dict, label: str, name: str) -> dict | None:
    """Row `label` against plain decoding on the same weights, prompt by prompt on set `name`: the
    median of its per-prompt tok/s ratios, their range, and on how many prompts it was at least as
    fast. Paired ratios cancel what makes one prompt faster than another (its length, where it
    stops), which the ratio of medians keeps; None for rows without a plain row."""
    plain = report["rows"][label].get("plain")
    if plain is None or plain not in report["rows"]:
        return None
    mine = report["rows"][label]["sets"][name]["tok_s_per_prompt"]
    base = report["rows"][plain]["sets"][name]["tok_s_per_prompt"]
    ratios = [a / b for a, b in zip(mine, base) if b > 0]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "at_least": sum(r >= 1.0 for r in ratios), "of": len(ratios)}


def render_against_plain(report: dict) -> list[str]:
    """The table of `against_plain` for every specrt row that has a plain row."""
    sets = list(report["sets"])
    lines = ["", "### against plain decoding, prompt by prompt", "",
             "Each row's tok/s on a prompt divided by plain decoding's on the same prompt (same weights, same "
             "run): the median of those ratios, their range, and the prompts on which the row was at least as "
             "fast as plain decoding." + (" The second plain engine's ratios are the run's noise floor: two "
                                         "identical configurations differ by that much."
                                         if any(label.endswith(TWIN_SUFFIX) for label in report["rows"])
                                         else ""), "",
             "| configuration |" + "".join(f" {SET_TITLES.get(s, s)}: median | range | at least plain |" for s in sets),
             "|---|" + "---|---|---|" * len(sets)]
    rows = 0
    for label in report["rows"]:
        found = [against_plain(report, label, s) for s in sets]
        if not any(found):
            continue
        rows += 1
        cells = "".join(" - | - | - |" if f is None else
                        f" {f['median']:.2f}x | {f['low']:.2f}-{f['high']:.2f} | {f['at_least']}/{f['of']} |"
                        for f in found)
        lines.append(f"| {label} |{cells}")
    return lines if rows else []


def render_costs(report: dict) -> list[str]:
    """The "where the time goes" table: one line per specrt row and set (module docstring)."""
    lines = ["", "### where the time goes", "",
             "Medians over each set's prompts; ms per verify round of the target. A round costs draft + verify + "
             "host; tok/s (prefill included) is about tau / round time. Arms: rounds of each way of drafting "
             "(`--drafter auto` and the named choices' probes; a request's last round is not counted).", "",
             "| configuration | set | tau | draft ms/round | verify ms/round | host ms/round | prefill ms | tok/s "
             "| arms (share of rounds) |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = 0
    for label, entry in report["rows"].items():
        for s, c in entry["sets"].items():
            cost = c.get("cost")
            if cost is None:
                continue
            rows += 1
            cells = [_number(cost["tau"], 2)] + [_number(cost[k], 1) for k in (
                "draft_ms_per_round", "verify_ms_per_round", "host_ms_per_round", "prefill_ms")]
            lines.append(f"| {label} | {SET_TITLES.get(s, s)} | " + " | ".join(cells)
                         + f" | {c['median_tok_s']:.1f} | {_arm_shares(c.get('arm_rounds'))} |")
    return lines if rows else []


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _arm_shares(rounds: dict[str, int] | None) -> str:
    total = sum((rounds or {}).values())
    if not total:
        return "-"
    named = {arm: arm.replace("+lookup", " + copies").replace("lookup", "copies") for arm in rounds}
    return ", ".join(f"{named[arm]} {100.0 * n / total:.0f}%"
                     for arm, n in sorted(rounds.items(), key=lambda kv: -kv[1]))


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
