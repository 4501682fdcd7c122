"""`specrt calibrate`: profile SPS(B) (target steps/s vs token positions per step) on this device.

    specrt calibrate --engines engines/NAME              -> engines/NAME/sps.json + sps.png + lookup.json
                                                          (+ datastore.npz where a data set fits the target)
    specrt calibrate --backend torch --out runs/sps      -> runs/sps/sps.json + sps.png

The confidence schedule of `specrt serve` / the serving bench reads it (see
`specrt.runtime.serving.calibrate` for what is measured). It is specific to the device, backend,
thread count and slot count: re-run it when they change. lookup.json holds the copy hit rates the
lookup proposer starts from (`specrt.runtime.proposers.lookup_prior`): replayed over a data set the
target generated (the shipped ones for the embedded default, a few seconds) or over plain greedy
responses this engine generates for --lookup-prompts ShareGPT prompts. datastore.npz, where a data
set fits the target, is the store of its responses the lookup also copies from
(`specrt.runtime.proposers.datastore`); lookup.json then holds the store's hit rates too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specrt.tools.cli_serve import add_model_arguments, add_shared_batches_argument

    add_model_arguments(p)
    add_shared_batches_argument(p)  # profile the batch mode the server will run
    p.add_argument("--slots", type=int, default=8, help="KV rows, as `specrt serve --slots` (default 8)")
    p.add_argument("--context", type=int, default=128, help="tokens already in each row while timing (default 128)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="largest B to profile (default: slots x (the drafter's verify size), or slots x 16)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (median; default 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", help="folder for sps.json + sps.png (default: the engine folder; torch: runs/sps/NAME)")
    p.add_argument("--lookup-data", default="auto",
                   help="copy hit rates for lookup.json: a data folder built by `specrt train data` with this "
                        "target; auto: the shipped one made by this target, else --lookup-prompts generated "
                        "responses; none: skip (specrt.runtime.proposers.lookup_prior)")
    p.add_argument("--lookup-prompts", type=int, default=24,
                   help="ShareGPT prompts to generate plain greedy responses for when no data set fits (default 24)")


def run(args: argparse.Namespace) -> int:
    from specrt.plugins.errors import SpecrtError
    from specrt.tools.cli_generate import resolve_backend
    from specrt.export.manifest import record_files
    from specrt.runtime.serving.calibrate import SPS_FILE, plot_sps, profile_sps
    from specrt.tools.cli_generate import load_pipeline

    backend = resolve_backend(args)
    if args.slots < 1 or args.context < 1 or args.repeats < 1 or args.warmup < 0:
        raise SpecrtError("--slots, --context and --repeats must be >= 1 (--warmup >= 0)",
                          "e.g. --slots 8 --context 128 --repeats 5")
    pipe = load_pipeline(args)
    verify = pipe.proposer.max_drafts + 1 if pipe.proposer is not None else 16
    max_tokens = args.max_tokens or args.slots * verify
    engine = pipe.engine_for(args.context + max_tokens // args.slots + 1, args.slots)
    engine.set_taps(pipe.proposer.tap_layers if pipe.proposer is not None else ())
    out = Path(args.out) if args.out else (Path(args.engines) if args.engines else Path("runs/sps") / pipe.name)
    out.mkdir(parents=True, exist_ok=True)
    print(f"profiling {pipe.name} ({backend}, {args.device}) with {args.slots} slots at context {args.context}",
          file=sys.stderr)

    def progress(b, rows, t, sps):
        print(f"  B={b:4d} ({rows} rows x {t} tokens): {sps:8.2f} steps/s  {1000.0 / sps:7.2f} ms/step", file=sys.stderr)

    table = profile_sps(engine, max_tokens, args.context, args.repeats, args.warmup, progress=progress,
                        meta={"engine": pipe.name, "backend": backend, "device": args.device,
                              "drafter": pipe.proposer.name if pipe.proposer is not None else "none"})
    table.save(out / SPS_FILE)
    record_files(out, [SPS_FILE])  # in an engine folder: the runtime checks it against the manifest
    try:
        plot_sps(table, out / "sps.png")
        print(f"wrote {out / SPS_FILE} and {out / 'sps.png'}", file=sys.stderr)
    except ImportError:
        print(f"wrote {out / SPS_FILE} (no plot: pip install matplotlib)", file=sys.stderr)
    if args.lookup_data != "none":
        calibrate_lookup(pipe, args, out)
    return 0


def target_name(pipe, args: argparse.Namespace) -> str:
    if getattr(args, "engines", None):
        from specrt.export.manifest import load_manifest

        return str(load_manifest(args.engines, verify_checksums=False).data["target"]["name"])
    return pipe.name


def calibrate_lookup(pipe, args: argparse.Namespace, out: Path) -> None:
    """lookup.json: copy hit rates replayed over this target's own greedy text (lookup_prior.py)."""
    from specrt.plugins.errors import SpecrtError
    from specrt.runtime.proposers.lookup_prior import LOOKUP_FILE
    from specrt.tools.copy_files import replay_hits
    from specrt.tools.copy_files import report_prior, shipped_data_for, write_lookup_files

    settings = lookup_settings(pipe)
    data = shipped_data_for(target_name(pipe, args)) if args.lookup_data == "auto" else [Path(args.lookup_data)]
    if data:
        write_lookup_files(data, out, settings)
        return
    pairs = generate_responses(pipe, args.lookup_prompts)
    if pairs is None:
        return
    prior = replay_hits(pairs, meta={"source": f"{len(pairs)} ShareGPT prompts, plain greedy on this engine"},
                        **settings)
    if not prior.trials:
        raise SpecrtError("the lookup replay found no repeated text to count", "pass a larger --lookup-data set")
    prior.save(out / LOOKUP_FILE)
    report_prior(prior, out / LOOKUP_FILE)
    print("lookup: no data set for a copy datastore (datastore.npz): copies come from each request's own text",
          file=sys.stderr)


def lookup_settings(pipe) -> dict:
    """The pipeline's lookup settings (the defaults when it drafts without copies)."""
    from specrt.runtime.proposers.lookup import NgramLookup

    lookup = getattr(pipe.proposer, "lookup", None) or NgramLookup()
    return {"max_tokens": lookup.max_tokens, "min_match": lookup.min_match, "max_match": lookup.max_match}


def generate_responses(pipe, count: int, max_new_tokens: int = 256, max_prompt_tokens: int = 256):
    """(prompt, plain greedy response) for `count` ShareGPT first turns; None without the data wheel,
    or when no prompt fits the target's positions.

    Prompt and response share the target's positions (max_position_embeddings): the response gets at
    most half of them, and only prompts that leave it that much room are used, so a short-context
    target is calibrated on shorter text instead of refusing the request."""
    import random

    from specrt.plugins.errors import SpecrtError
    from specrt.tools.datasets import sharegpt_first_turns
    from tqdm import tqdm

    try:
        turns = sharegpt_first_turns()
    except SpecrtError as e:
        print(f"lookup: no data set fits this target and {e.problem}; skipped lookup.json ({e.fix})", file=sys.stderr)
        return None
    random.Random(0).shuffle(turns)
    positions = int(pipe.config.max_position_embeddings)
    new_tokens = min(max_new_tokens, positions // 2)
    longest = min(max_prompt_tokens, positions - new_tokens)
    prompts = [ids for ids in (pipe.tokenizer.encode_chat(text) for _, text in turns) if len(ids) <= longest][:count]
    if not prompts:
        print(f"lookup: no ShareGPT prompt fits {longest} tokens (the target has {positions} positions); "
              "skipped lookup.json (pass --lookup-data with a data set built for this target)", file=sys.stderr)
        return None
    pairs = []
    for prompt in tqdm(prompts, desc="lookup: plain greedy responses", unit="prompt", file=sys.stderr):
        result = pipe.generate_ids([prompt], new_tokens, speculative=False)
        pairs.append((prompt, result.tokens[0]))
    return pairs
