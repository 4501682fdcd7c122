"""`python export/export.py --drafter {eagle3,dflash,dspark,none}`: the target and its drafter as ONNX.

    python export/export.py --drafter dspark --drafter-ckpt PATH [--target PATH] [--out engines/NAME]
                            [--dtype fp32|fp16] [--opset N] [--capacity N] [--external-data auto|always|never]
    python -m specrt.export.export ...        (same; `python -m specrt.export` too)

Without --target the embedded default (SmolLM2-135M-Instruct) is exported, with the drafter of
that kind shipped in the package when there is one; otherwise pass --drafter-ckpt (an
official-format drafter folder), or `--drafter none` to export only the target.

Stages print as they finish (time, peak RSS, graph size). The output folder is written atomically:
everything goes to a hidden temp folder beside --out, is validated (checker, shape inference,
manifest checksums), and only then renamed into place. A failed export leaves no folder that looks
valid and never touches an existing one.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    # run as a file: do not let export/ shadow top-level modules; import through the specrt package
    sys.path.pop(0)

import argparse
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specrt.plugins.errors import SpecrtError, run_reporting_errors
from specrt.runtime.proposers.lookup import DEFAULT_LOOKUP_THRESHOLD, DEFAULT_LOOKUP_TOKENS

DRAFTER_KINDS = ("eagle3", "dflash", "dspark", "none")
_DTYPE_FLAGS = {"fp32": "float32", "fp16": "float16", "float32": "float32", "float16": "float16"}
NO_DRAFTER_HINT = (
    "pass --drafter-ckpt PATH (an official-format EAGLE-3 / DFlash / DSpark drafter folder: config.json + "
    "model.safetensors), train one with `specrt train dflash|dspark|eagle3`, or use `--drafter none` to export only the target"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, choices=DRAFTER_KINDS,
                        help="drafter kind to export with the target ('none': the target alone)")
    parser.add_argument("--target", default=None, help="HF folder or .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--drafter-ckpt", default=None,
                        help="drafter checkpoint folder (official format; default: the shipped one, if any)")
    parser.add_argument("--out", default=None, help="engine folder (default: engines/<target>-<drafter>)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(_DTYPE_FLAGS), help="weights and K/V cache dtype")
    parser.add_argument("--opset", type=int, default=None, help="ONNX default-domain opset (18-23, default 20)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="K/V cache capacity recorded for the runtime (default: max_position_embeddings)")
    parser.add_argument("--external-data", default="auto", choices=("auto", "always", "never"),
                        help="store weights beside the graph (auto: graphs over 512 MiB)")
    # the default tree is sized for a CPU, where verify cost grows with every token (measured in
    # docs/numbers.md: 4/4/16 ran at 0.74x of plain decoding, 2/2/4 at 0.98x); GPUs want wider trees
    parser.add_argument("--tree-top-k", type=int, default=2, help="EAGLE-3 tree: children per node (manifest default)")
    parser.add_argument("--tree-depth", type=int, default=2, help="EAGLE-3 tree: depth (manifest default)")
    parser.add_argument("--tree-tokens", type=int, default=4, help="EAGLE-3 tree: verify tokens (manifest default)")
    parser.add_argument("--threshold", type=float, default=0.0, help="DSpark survival threshold (manifest default)")
    parser.add_argument("--lookup", type=int, default=DEFAULT_LOOKUP_TOKENS,
                        help="drafts copied from the request's own text per step, grafted onto the drafter's "
                             "(manifest default; 0: off; specrt.runtime.proposers.lookup)")
    parser.add_argument("--lookup-threshold", type=float, default=DEFAULT_LOOKUP_THRESHOLD,
                        help="verify a copied draft while its estimated survival is at least this (manifest default)")
    q = parser.add_argument_group("weight quantization (ONNX Runtime MatMulNBits; see specrt.export.quantize)")
    q.add_argument("--weights", default="fp32", choices=("fp32", "fp16", "int8", "int4", "w8a8", "gguf"),
                   help="weights of the linear layers: fp32/fp16 (= --dtype), int8/int4 (RTN, weight-only), w8a8 "
                        "(int8 weights and per-token int8 activations in integer MatMuls: verify rows nearly free "
                        "on CPUs with AMX/VNNI; specrt.export.integer_matmul) or gguf (the GGUF target's own "
                        "Q4_0/Q4_1/Q8_0 blocks, bit for bit)")
    q.add_argument("--quant-block", type=int, default=32, help="int8/int4: weights per scale block along K")
    q.add_argument("--quant-asymmetric", action="store_true", help="int8/int4: zero points per block (default symmetric)")
    q.add_argument("--no-quant-lm-head", action="store_true", help="int8/int4: keep the LM head in float")
    q.add_argument("--drafter-weights", default="same", choices=("same", "fp32", "int8", "int4", "w8a8"),
                   help="the drafter's graphs: same as --weights, or their own (e.g. an fp32 target with an int4 "
                        "drafter: drafting gets cheaper, verification stays fp32, so output is unchanged)")
    q.add_argument("--quant-accuracy-level", type=int, default=4, choices=(0, 1, 2, 3, 4),
                   help="MatMulNBits compute: 4 = int8 activations (fastest on CPU), 0 = float activations")
    parser.add_argument("--no-ort-fused", action="store_true",
                        help="skip target_ort, the ONNX Runtime contrib-op target graph (specrt.export.ort_fused) "
                             "that runs single streams ~1.5-2x faster on ORT's CPU provider; the portable graph "
                             "(any ONNX runtime, TensorRT) is always written")
    parser.add_argument("--no-lookup-files", action="store_true",
                        help="skip lookup.json and datastore.npz (copy hit rates and the 16 MB store of the target's "
                             "own answers, written for a target whose data specrt ships): copies then start from a "
                             "flat prior and come from the request's own text only")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


class _Stages:
    """Progress per stage: one line when a stage finishes (time, peak RSS), a spinner while it runs."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.console = None
        if not quiet:
            from rich.console import Console

            self.console = Console(stderr=True)
        self.start = time.perf_counter()
        self.records: list[tuple[str, float]] = []

    @contextmanager
    def stage(self, label: str) -> Iterator[dict]:
        info: dict = {}
        t0 = time.perf_counter()
        if self.console is not None and self.console.is_terminal:
            with self.console.status(f"{label} ..."):
                yield info
        else:
            yield info
        seconds = time.perf_counter() - t0
        self.records.append((label, seconds))
        if self.console is not None:
            note = f"  [dim]{info['note']}[/dim]" if info.get("note") else ""
            stats = f"{seconds:.1f} s, peak RSS {peak_rss_mb():.0f} MB"
            self.console.print(f"[green]✓[/green] {label} [dim]{stats}[/dim]{note}")

    def print(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)


def peak_rss_mb() -> float:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    except Exception:  # pragma: no cover - non-Unix
        return float("nan")


def _shipped_drafter(kind: str) -> Path | None:
    """The drafter shipped in the package for the embedded default target, if there is one."""
    try:
        from specrt.export.default_model import DEFAULT_NAME
        from specrt.export.shipped import shipped_drafter
    except ImportError:
        return None
    return shipped_drafter(kind, DEFAULT_NAME)


def _source_of(loaded_target) -> str | None:
    source = getattr(loaded_target, "source", None)
    return str(Path(source).resolve()) if source else None


def _default_out(target_name: str, kind: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in target_name)
    return Path("engines") / (f"{safe}-{kind}" if kind != "none" else safe)


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise SpecrtError(f"--out {out} is a file", "pass a folder path for the engine")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise SpecrtError(
            f"--out {out} exists and is not a specrt engine folder (no manifest.json); refusing to replace it",
            "pick another --out, or empty that folder yourself",
        )


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename tmp to out; an existing engine folder is moved aside first and removed only afterwards."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_engine(
    drafter_kind: str,
    target: str | Path | None = None,
    drafter_ckpt: str | Path | None = None,
    out: str | Path | None = None,
    dtype: str = "fp32",
    opset: int | None = None,
    capacity: int | None = None,
    external_data: str = "auto",
    tree: dict | None = None,
    threshold: float = 0.0,
    quiet: bool = False,
    loaded_target=None,
    drafter_model=None,
    command: list[str] | None = None,
    quant=None,
    drafter_quant="same",
    ort_fused: bool = True,
    lookup: dict | None = None,
    lookup_files: bool = True,
) -> Path:
    """Export an engine folder; returns its path. `loaded_target` / `drafter_model` skip loading (tests)."""
    import torch

    from specrt.export import manifest as mf
    from specrt.export import onnx_export as ox
    from specrt.plugins import onnx_ops

    if drafter_kind not in DRAFTER_KINDS:
        raise SpecrtError(f"unknown drafter kind {drafter_kind!r}", f"use one of {', '.join(DRAFTER_KINDS)}")
    if dtype not in _DTYPE_FLAGS:
        raise SpecrtError(f"unsupported --dtype {dtype!r}", "use fp32 or fp16")
    dtype_name = _DTYPE_FLAGS[dtype]
    torch_dtype = ox.dtype_from_name(dtype_name)
    opset = onnx_ops.check_opset(opset if opset is not None else ox.DEFAULT_OPSET)
    if external_data not in ("auto", "always", "never"):
        raise SpecrtError(f"unknown --external-data {external_data!r}", "use auto, always or never")
    if drafter_kind != "none" and drafter_ckpt is None and drafter_model is None:
        drafter_ckpt = _shipped_drafter(drafter_kind) if target is None else None
        if drafter_ckpt is None:
            shipped_for = "" if target is None else " (shipped drafters exist only for the embedded default target)"
            raise SpecrtError(f"no {drafter_kind} drafter checkpoint given, and none is shipped{shipped_for}",
                              NO_DRAFTER_HINT)
    if drafter_kind == "none" and drafter_ckpt is not None:
        raise SpecrtError("--drafter none was given together with --drafter-ckpt",
                          "pass --drafter eagle3|dflash|dspark with the checkpoint, or drop --drafter-ckpt")
    stages = _Stages(quiet)

    # 1. load (nothing is written before both models are known to fit)
    with stages.stage("load target") as info:
        if loaded_target is None:
            from specrt.export.checkpoints import load_target

            loaded_target = load_target(target, torch_dtype)
        model = loaded_target.model.to(torch_dtype).eval()
        cfg = model.config
        info["note"] = (f"{loaded_target.name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                        f"vocab {cfg.vocab_size}")
    drafter = drafter_model
    if drafter_kind != "none":
        with stages.stage(f"load {drafter_kind} drafter") as info:
            from specrt.export.checkpoints.drafters import check_fits_target, drafter_kind as kind_of, load_drafter

            if drafter is None:
                drafter = load_drafter(drafter_ckpt, cfg, kind=drafter_kind, dtype=torch_dtype)
            elif kind_of(drafter) != drafter_kind:
                raise SpecrtError(f"the drafter is a {kind_of(drafter)}, not a {drafter_kind}",
                                  f"pass --drafter {kind_of(drafter)}")
            check_fits_target(drafter.config, cfg)
            drafter = drafter.to(torch_dtype).eval()
            info["note"] = f"taps {list(drafter.config.tap_layers)}"

    out = Path(out) if out is not None else _default_out(loaded_target.name, drafter_kind)
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        specs = ox.graph_specs(model, drafter, torch_dtype)
        exported = []
        for spec in specs:
            with stages.stage(f"graph {spec.name}") as info:
                graph = ox.export_graph(spec, tmp, opset=opset, external_data=external_data)
                size = graph.path.stat().st_size + (graph.data_path.stat().st_size if graph.data_path else 0)
                info["note"] = f"{size / 2**20:.1f} MB{' (external data)' if graph.data_path else ''}"
                exported.append(graph)
        if ort_fused and torch_dtype == torch.float32:
            from specrt.export import ort_fused as fused

            reason = fused.supports(model)
            with stages.stage(f"graph {fused.GRAPH_NAME} (ONNX Runtime contrib ops)") as info:
                if reason:
                    info["note"] = f"skipped: {reason}"
                else:
                    graph = fused.export_fused_target(model, tmp, torch_dtype, external_data)
                    size = graph.path.stat().st_size + (graph.data_path.stat().st_size if graph.data_path else 0)
                    info["note"] = f"{size / 2**20:.1f} MB"
                    exported.append(graph)
        if drafter_quant == "same":
            drafter_quant = quant
        if quant is not None or drafter_quant is not None:
            from specrt.export.quantize import quantize_graph

            gguf_blocks = None
            if quant is not None and quant.weights == "gguf":
                from specrt.export.gguf_quant import read_gguf_blocks

                source = Path(str(getattr(loaded_target, "source", "")))
                if source.suffix != ".gguf":
                    raise SpecrtError(f"--weights gguf needs a GGUF target, not {source}",
                                      "pass --target model.gguf (or the embedded default), or use --weights int4")
                with stages.stage("read the GGUF's quantized blocks"):
                    gguf_blocks = read_gguf_blocks(source)
            for graph in exported:
                if graph.name.endswith("_fc") or graph.name.endswith("_ingest"):
                    continue  # a few MB each, run once per committed token: not worth the rounding
                # the drafter's graphs may have their own scheme: drafts only need to be likely, the
                # target's verification decides the output
                scheme = quant if graph.name.startswith("target") else drafter_quant
                if scheme is None:
                    continue
                with stages.stage(f"quantize {graph.name} to {scheme.weights}") as info:
                    q = quantize_graph(graph.path, scheme, external_data=graph.data_path is not None,
                                       gguf_blocks=gguf_blocks if scheme is quant else None)
                    size = graph.path.stat().st_size + (graph.data_path.stat().st_size if graph.data_path else 0)
                    info["note"] = f"{q['quantized']}/{q['matmuls']} MatMuls -> {q['op']}, {size / 2**20:.1f} MB"
        with stages.stage("tokenizer, manifest, checksums"):
            loaded_target.tokenizer.save(tmp)
            drafter_info = None
            if drafter is not None:
                roles = {g.name.split("_", 1)[1]: g.name for g in exported if not g.name.startswith("target")}
                extra: dict = {}
                if drafter_kind == "eagle3":
                    import numpy as np

                    ids = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size)).cpu().numpy()
                    np.save(tmp / "draft_to_target.npy", ids.astype(np.int64))
                    extra["draft_vocab"] = {"file": "draft_to_target.npy", "size": int(ids.shape[0]),
                                            "meaning": "target id of each draft id"}
                    t = {"top_k": 2, "depth": 2, "total_tokens": 4, **(tree or {})}
                    extra["tree"] = t
                    extra["num_drafts"] = t["total_tokens"] - 1
                if lookup:
                    extra["lookup"] = dict(lookup)
                if drafter_kind == "dspark":
                    extra["policy"] = {"threshold": float(threshold), "sps": None,
                                       "note": "sps: a table of steps/s by verify tokens, profiled per device"}
                drafter_info = mf.drafter_section(
                    drafter, str(Path(drafter_ckpt).resolve()) if drafter_ckpt else None, cfg, roles, extra
                )
            options = {
                "dtype": dtype_name, "opset": opset, "external_data": external_data,
                "weights": quant.to_dict() if quant is not None else {"bits": None, "scheme": dtype_name},
                "kv_capacity": int(capacity or cfg.max_position_embeddings),
                **({"drafter_weights": drafter_quant.to_dict() if drafter_quant is not None
                    else {"bits": None, "scheme": dtype_name}} if drafter is not None else {}),
                "command": command,
                "seconds": round(time.perf_counter() - stages.start, 1),
            }
            manifest = mf.build_manifest(
                tmp, name=out.name, target_model=model, target_name=loaded_target.name,
                target_source=_source_of(loaded_target),
                chat_template=loaded_target.tokenizer.chat_template, graphs=exported,
                drafter_info=drafter_info, export_options=options,
            )
            mf.write_manifest(tmp, manifest)
            mf.load_manifest(tmp)  # the folder must pass the runtime's own checks before it goes live
        if lookup_files:
            _write_lookup_files(stages, tmp, loaded_target.name)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    stages.print(f"[bold]{out}[/bold]: {len(exported)} graphs, {total / 2**20:.1f} MB, "
                 f"{time.perf_counter() - stages.start:.1f} s, peak RSS {peak_rss_mb():.0f} MB")
    return out


def _write_lookup_files(stages, folder: Path, target_name: str) -> None:
    """lookup.json + datastore.npz (copy hit rates and the store of the target's own answers) when
    specrt ships a data set this target generated: the lookup then starts calibrated, as after
    `specrt calibrate`. Written after the manifest, like calibrate's files: outside the checksums."""
    from specrt.runtime.proposers.lookup_prior import shipped_data_for, write_lookup_files

    data = shipped_data_for(target_name)
    if not data:
        return
    with stages.stage("copy hit rates and datastore (shipped data sets)") as info:
        write_lookup_files(data, folder, progress=lambda message: None)  # the stage line reports it
        info["note"] = f"{len(data)} data sets"


def quant_options(args: argparse.Namespace):
    """QuantOptions for --weights int8/int4 (None for float weights); --weights fp16 means --dtype fp16."""
    if args.weights in ("fp32", "fp16"):
        if args.weights == "fp16" and args.dtype not in ("fp16", "float16"):
            args.dtype = "fp16"
        return None
    return _rtn_options(args, args.weights, "--weights")


def _rtn_options(args: argparse.Namespace, weights: str, flag: str):
    """QuantOptions for `weights` (int8/int4/gguf) with the shared --quant-* flags; fp32 graphs only."""
    if args.dtype not in ("fp32", "float32"):
        raise SpecrtError(f"{flag} {weights} quantizes fp32 graphs, not --dtype {args.dtype}",
                          "drop --dtype (quantized weights run with fp32 activations and norms)")
    from specrt.export.quantize import QuantOptions

    return QuantOptions(weights, args.quant_block, not args.quant_asymmetric, args.quant_accuracy_level,
                        lm_head=not args.no_quant_lm_head)


def drafter_quant_options(args: argparse.Namespace, quant):
    """The drafter graphs' QuantOptions: "same" as the target's, None for float, or their own int8/int4."""
    if args.drafter_weights == "same":
        return quant
    if args.drafter_weights == "fp32":
        if args.dtype not in ("fp32", "float32"):
            raise SpecrtError(f"--drafter-weights fp32 with --dtype {args.dtype}",
                              "drop --drafter-weights (the drafter follows --dtype) or export with --dtype fp32")
        return None
    return _rtn_options(args, args.drafter_weights, "--drafter-weights")


def lookup_defaults(args: argparse.Namespace) -> dict | None:
    """The manifest's `drafter.lookup` record from --lookup / --lookup-threshold (None: off)."""
    from specrt.runtime.proposers.factory import DraftOptions

    if args.lookup <= 0:
        return None
    return DraftOptions(lookup=args.lookup, lookup_threshold=args.lookup_threshold).lookup_manifest()


def run(args: argparse.Namespace) -> int:
    quant = quant_options(args)
    drafter_quant = drafter_quant_options(args, quant)
    if args.drafter == "none" and args.drafter_weights != "same":
        raise SpecrtError(f"--drafter-weights {args.drafter_weights} without a drafter",
                          "pass --drafter KIND, or drop --drafter-weights")
    lookup_defaults(args)  # bad values fail before the long export
    export_engine(
        args.drafter, target=args.target, drafter_ckpt=args.drafter_ckpt, out=args.out, dtype=args.dtype,
        opset=args.opset, capacity=args.capacity, external_data=args.external_data,
        tree={"top_k": args.tree_top_k, "depth": args.tree_depth, "total_tokens": args.tree_tokens},
        threshold=args.threshold, quiet=args.quiet, command=list(sys.argv), quant=quant,
        drafter_quant=drafter_quant, ort_fused=not args.no_ort_fused, lookup=lookup_defaults(args),
        lookup_files=not args.no_lookup_files,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specrt export", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_reporting_errors("specrt export", lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
