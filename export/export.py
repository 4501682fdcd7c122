"""Export an engine folder: the target and its drafter as ONNX graphs, a manifest, the tokenizer.

    export_engine("dspark", drafter_ckpt=PATH, target=None, out="engines/NAME", quant=..., draft_options=...)

The command line is `specrt export` (`specrt.tools.cli_export`). Without a target the embedded
default (SmolLM2-135M-Instruct) is exported, with the drafter of that kind shipped in the package
when there is one.

DFlash/DSpark block heads cover the target's `DEFAULT_BLOCK_DRAFT_VOCAB` most frequent tokens where the
caller gives the target's token counts (`block_draft_vocab`; the CLI counts the responses of the data
sets specrt ships for the target): the ids go to draft_to_target.npy and the manifest's drafter section.

Stages print as they finish (time, peak RSS, graph size). The output folder is written atomically:
everything goes to a hidden temp folder beside `out`, is validated (checker, shape inference,
manifest checksums), and only then renamed into place. A failed export leaves no folder that looks
valid and never touches an existing one. An existing engine folder is replaced only with
`overwrite=True` (`--overwrite`): the replacement is atomic, and files a user added there go with
the old folder. A destination that cannot be written (read-only, no permission, a full disk) is a
SpecrtError naming the path.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from specrt.plugins.errors import SpecrtError
from specrt.export.draft_options import DraftOptions

DRAFTER_KINDS = ("eagle3", "dflash", "dspark", "none")
BLOCK_KINDS = ("dflash", "dspark")
# DFlash/DSpark: the block head's logits over this many of the target's most frequent tokens, where the
# target's token counts exist (`block_draft_vocab`). The head over all tokens was most of a drafting
# round; 8192 of SmolLM2's 49152 cover 94% of held-out responses, halve the round and keep tau
# (docs/choosing-a-drafter.md, "Reduced draft vocabulary").
DEFAULT_BLOCK_DRAFT_VOCAB = 8192
DRAFT_VOCAB_FILE = "draft_to_target.npy"
_DTYPE_FLAGS = {"fp32": "float32", "fp16": "float16", "float32": "float32", "float16": "float16"}
NO_DRAFTER_HINT = (
    "pass --drafter-ckpt PATH (an official-format EAGLE-3 / DFlash / DSpark drafter folder: config.json + "
    "model.safetensors), train one with `specrt train dflash|dspark|eagle3`, or use `--drafter none` to export only the target"
)


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


def _check_out(out: Path, overwrite: bool = False) -> None:
    if out.exists() and not out.is_dir():
        raise SpecrtError(f"--out {out} is a file", "pass a folder path for the engine")
    if (out / "manifest.json").is_file() and not overwrite:
        raise SpecrtError(f"--out {out} is an existing engine folder",
                          "pass --overwrite to replace it (files added to it are deleted with it), or pick another --out")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise SpecrtError(
            f"--out {out} exists and is not a specrt engine folder (no manifest.json); refusing to replace it",
            "pick another --out, or empty that folder yourself",
        )


_UNWRITABLE = {errno.EROFS: "is on a read-only file system", errno.EACCES: "is not writable (permission denied)",
               errno.EPERM: "is not writable (operation not permitted)", errno.ENOSPC: "is on a full disk",
               errno.EDQUOT: "is on a disk over its quota"}


def _unwritable(exc: OSError, out: Path) -> SpecrtError | None:
    """The clear error for a destination that cannot take the folder (None: another OSError)."""
    if exc.errno not in _UNWRITABLE:
        return None
    path = exc.filename or out.parent
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return SpecrtError(f"cannot write the engine folder: {path} {_UNWRITABLE[exc.errno]}",
                       "free some space there, or pass --out on another disk" if full else
                       "pass --out a folder you can write to")


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


def most_frequent_tokens(counts, size: int, always: Sequence[int] = ()):
    """(ids, coverage): the `size` target ids to keep, ascending: `always` first, then the most frequent
    tokens of `counts` ([V] occurrences in the target's own text; ties: lower id first, so tokens the
    text never shows fill up from the lowest ids), and the share of the counted tokens they cover."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.int64)
    vocab = int(counts.shape[0])
    if not 1 <= size < vocab:
        raise SpecrtError(f"a draft vocabulary of {size} tokens does not reduce the target's {vocab}",
                          f"pass --draft-vocab between 1 and {vocab - 1}, or 0 for the full vocabulary")
    forced = np.zeros(vocab, dtype=bool)
    forced[[int(t) for t in always if 0 <= int(t) < vocab]] = True
    if int(forced.sum()) > size:
        raise SpecrtError(f"a draft vocabulary of {size} tokens cannot hold the {int(forced.sum())} it must keep",
                          "pass a larger --draft-vocab")
    order = np.lexsort((np.arange(vocab), -counts))  # count descending, then id ascending
    rest = order[~forced[order]][: size - int(forced.sum())]
    ids = np.sort(np.concatenate([np.flatnonzero(forced), rest])).astype(np.int64)
    return ids, float(counts[ids].sum() / max(int(counts.sum()), 1))


def block_draft_vocab(size: int | None, token_counts, target_name: str, target_cfg):
    """The reduced vocabulary of a DFlash/DSpark block head: (ids [N] int64 ascending, manifest record),
    or (None, note) for the full vocabulary.

    size: None -> DEFAULT_BLOCK_DRAFT_VOCAB where the target's token counts exist (else the full
    vocabulary); 0 -> the full vocabulary; N -> N tokens (the counts must exist).
    token_counts(target_name, vocab_size) -> (counts [V], what was counted) or None.
    The target's end-of-sequence ids are always kept: an answer ends with one. The block's MASK token is
    an input only (its embedding row), never a draft, so it needs no head row."""
    wanted = DEFAULT_BLOCK_DRAFT_VOCAB if size is None else int(size)
    if not wanted:
        return None, "full vocabulary"
    found = token_counts(target_name, int(target_cfg.vocab_size)) if token_counts is not None else None
    if found is None:
        if size is None:
            return None, "full vocabulary (no token counts of this target's text)"
        raise SpecrtError(f"--draft-vocab {size} needs token counts of {target_name}'s own text, and none were given",
                          "pass --draft-vocab-data FOLDER (a data set of its responses built by `specrt train data`), "
                          "or --draft-vocab 0 for the full vocabulary")
    counts, source = found
    ids, coverage = most_frequent_tokens(counts, wanted, target_cfg.eos_token_ids)
    record = {"file": DRAFT_VOCAB_FILE, "size": int(ids.shape[0]), "meaning": "target id of each draft id",
              "source": source, "coverage": round(coverage, 4)}
    return ids, record


def export_engine(
    drafter_kind: str,
    target: str | Path | None = None,
    drafter_ckpt: str | Path | None = None,
    out: str | Path | None = None,
    dtype: str = "fp32",
    opset: int | None = None,
    capacity: int | None = None,
    external_data: str = "auto",
    quiet: bool = False,
    loaded_target=None,
    drafter_model=None,
    command: list[str] | None = None,
    quant=None,
    drafter_quant="same",
    ort_fused: bool = True,
    draft_options: DraftOptions | None = None,
    extra_files: Callable[[Path, str], str | None] | None = None,
    overwrite: bool = False,
    draft_vocab: int | None = None,
    token_counts: Callable[[str, int], tuple | None] | None = None,
) -> Path:
    """Export an engine folder; returns its path. `loaded_target` / `drafter_model` skip loading (tests).

    overwrite: replace an existing engine folder at `out` (refused otherwise, before anything is loaded).
    draft_options: the drafting defaults the folder records (`specrt.export.draft_options`).
    extra_files(folder, target_name): writes more files into the folder before its manifest is built
    (the CLI passes the copy datastore and hit rates, which the runtime's proposers compute); returns a
    note for the progress line, or None when it wrote nothing.
    draft_vocab, token_counts: a DFlash/DSpark block head over the target's most frequent tokens only
    (`block_draft_vocab`: None is the default, 0 the full vocabulary); token_counts(target_name,
    vocab_size) returns ([V] occurrences in the target's own text, what was counted) or None.
    """
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
    if draft_vocab and drafter_kind not in BLOCK_KINDS:
        raise SpecrtError(f"--draft-vocab applies to DFlash/DSpark block heads, not to --drafter {drafter_kind}",
                          "drop --draft-vocab (an EAGLE-3 checkpoint brings its own draft vocabulary)")
    if draft_vocab is not None and draft_vocab < 0:
        raise SpecrtError(f"--draft-vocab must be >= 0, got {draft_vocab}", "pass 0 for the full vocabulary, or N > 0")
    if drafter_kind != "none" and drafter_ckpt is None and drafter_model is None:
        drafter_ckpt = _shipped_drafter(drafter_kind) if target is None else None
        if drafter_ckpt is None:
            shipped_for = "" if target is None else " (shipped drafters exist only for the embedded default target)"
            raise SpecrtError(f"no {drafter_kind} drafter checkpoint given, and none is shipped{shipped_for}",
                              NO_DRAFTER_HINT)
    if drafter_kind == "none" and drafter_ckpt is not None:
        raise SpecrtError("--drafter none was given together with --drafter-ckpt",
                          "pass --drafter eagle3|dflash|dspark with the checkpoint, or drop --drafter-ckpt")
    if out is not None:
        _check_out(Path(out), overwrite)  # before the long load and export
    draft_options = draft_options or DraftOptions()
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
    _check_out(out, overwrite)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        raise (_unwritable(exc, out) or exc) from None
    try:
        block_vocab = None
        if drafter_kind in BLOCK_KINDS:
            with stages.stage("draft vocabulary") as info:
                block_vocab, vocab_record = block_draft_vocab(draft_vocab, token_counts, loaded_target.name, cfg)
                info["note"] = vocab_record if block_vocab is None else (
                    f"{vocab_record['size']} of {cfg.vocab_size} tokens, {vocab_record['coverage']:.1%} of "
                    f"{vocab_record['source']}")
        specs = ox.graph_specs(model, drafter, torch_dtype,
                               None if block_vocab is None else torch.from_numpy(block_vocab))
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
            for causal in (False, True):  # target_ort and its causal twin for plain decoding
                name = fused.CAUSAL_GRAPH_NAME if causal else fused.GRAPH_NAME
                with stages.stage(f"graph {name} (ONNX Runtime contrib ops)") as info:
                    if reason:
                        info["note"] = f"skipped: {reason}"
                        break
                    graph = fused.export_fused_target(model, tmp, torch_dtype, external_data, causal)
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
        if external_data != "never":  # never: each graph keeps its own weights inside it
            from specrt.export.shared_weights import share_weights

            with stages.stage("one weights file, each tensor once") as info:
                info["note"] = share_weights(tmp, exported).note()
        if extra_files is not None:
            with stages.stage("extra files") as info:
                info["note"] = extra_files(tmp, loaded_target.name)
        with stages.stage("tokenizer, manifest, checksums"):
            loaded_target.tokenizer.save(tmp)
            drafter_info = None
            if drafter is not None:
                roles = {g.name.split("_", 1)[1]: g.name for g in exported if not g.name.startswith("target")}
                extra: dict = {}
                if drafter_kind == "eagle3":
                    import numpy as np

                    ids = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size)).cpu().numpy()
                    np.save(tmp / DRAFT_VOCAB_FILE, ids.astype(np.int64))
                    extra["draft_vocab"] = {"file": DRAFT_VOCAB_FILE, "size": int(ids.shape[0]),
                                            "meaning": "target id of each draft id"}
                    extra["num_drafts"] = draft_options.tree_tokens - 1
                elif block_vocab is not None:
                    import numpy as np

                    np.save(tmp / DRAFT_VOCAB_FILE, block_vocab)
                    extra["draft_vocab"] = vocab_record
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
            manifest["drafting"] = draft_options.manifest_record()
            mf.write_manifest(tmp, manifest)
            mf.load_manifest(tmp)  # the folder must pass the runtime's own checks before it goes live
        _swap_into_place(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        clear = _unwritable(exc, out) if isinstance(exc, OSError) else None
        if clear is not None:
            raise clear from None
        raise
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    stages.print(f"[bold]{out}[/bold]: {len(exported)} graphs, {total / 2**20:.1f} MB, "
                 f"{time.perf_counter() - stages.start:.1f} s, peak RSS {peak_rss_mb():.0f} MB")
    return out
