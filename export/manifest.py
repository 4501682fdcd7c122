"""`engines/<name>/manifest.json`: the one contract between export and runtime (DESIGN.md section 2).

    manifest = build_manifest(folder, target=..., drafter=..., graphs=..., ...)   (the exporter)
    write_manifest(folder, manifest)
    engine = load_manifest(folder)      validates; raises SpecrtError naming the file and the fix

Layout (format "specrt.engine", format_version 1):

    format, format_version, name, created (UTC ISO time)
    versions      {specrt, torch, onnx, onnxscript, onnxruntime, python}: what produced the folder
    export        {dtype, opset, external_data, kv_capacity, command}
    target        {name, source, config (LlamaConfig fields), tap_layers, hidden_size, num_layers,
                   vocab_size, eos_token_ids, bos_token_id, chat_template, fingerprint,
                   kv_cache {layout, dtype, capacity}}
    drafter       null, or {kind, source, config (drafter config fields), target_fingerprint,
                   graphs {role: graph name}, ...kind specifics: num_drafts, label_shift;
                   eagle3: draft_vocab_size, draft_vocab {file, size}, tree {top_k, depth,
                   total_tokens}; dflash/dspark: block_size, mask_token_id, optional draft_vocab
                   {file, size, source, coverage} (a block head over those target ids only:
                   `specrt export --draft-vocab N`); dspark: markov_rank,
                   markov_variant, sts_temperatures, policy {threshold, sps}; any kind: lookup
                   {max_tokens, threshold, min_match, max_match, alone_above}, the runtime's default
                   for drafts copied from the request's text (specrt.runtime.proposers.lookup)}
    graphs        {name: {file, data (the external-data file it reads, or null: weights.data, one file
                   that all graphs share, each tensor stored once: specrt.export.shared_weights),
                   description, custom_ops,
                   inputs [{name, dtype, shape}], outputs [{name, dtype, shape}], runtime ("any", or
                   "onnxruntime" for target_ort and target_ort_causal, which use ORT contrib ops:
                   specrt.export.ort_fused)}}
                   shapes mix ints and dimension names (batch, seq, rows, past, capacity, block, ...)
    custom_ops    [{domain, name, version, graphs}]: each a model-local function in those graphs
    tokenizer     {file: tokenizer.json, config: tokenizer_config.json}
    files         {relative path: {sha256, bytes}} for every file in the folder but manifest.json

Trust: every file the runtime reads is in `files` and is checked on load. That includes the
calibration files (sps.json, lookup.json, datastore.npz: `CALIBRATION_FILES`), which `specrt
calibrate` writes after export: saving one into an engine folder records its checksum
(`record_files`), and a calibration file in a folder whose manifest does not list it is refused
rather than read unchecked. A listed file that is a symlink leading out of the folder (or a path
through one) is refused: the folder must be self-contained, so what was checked is what runs.

The target fingerprint is the sha256 of the target's config (canonical JSON); a drafter records the
fingerprint of the target it was exported for, so a drafter section grafted onto another target's
folder is refused even when the widths happen to agree.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import platform
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig

FORMAT = "specrt.engine"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST = "manifest.json"
CALIBRATION_FILES = ("sps.json", "lookup.json", "datastore.npz")  # written after export; read when present
_REEXPORT = "re-export the engine folder: specrt export --drafter KIND [--target ...] --out FOLDER"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def target_fingerprint(config: LlamaConfig | dict) -> str:
    data = config.to_dict() if isinstance(config, LlamaConfig) else dict(config)
    data.pop("eos_token_ids", None)  # the tokenizer may add end-of-turn ids; they do not change the weights' shape
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("specrt", "torch", "onnx", "onnxscript", "onnxruntime"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def files_table(folder: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under folder (manifest.json excluded), by relative posix path."""
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST:
            continue
        out[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return out


def _config_dict(cfg) -> dict[str, Any]:
    return json.loads(json.dumps(cfg.to_dict()))


def drafter_section(drafter, source: str | None, target_cfg: LlamaConfig, graphs: dict[str, str],
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    from specrt.export.checkpoints.drafters import drafter_kind

    kind = drafter_kind(drafter)
    cfg = drafter.config
    section: dict[str, Any] = {
        "kind": kind,
        "source": source,
        "config": _config_dict(cfg),
        "target_fingerprint": target_fingerprint(target_cfg),
        "tap_layers": list(cfg.tap_layers),
        "graphs": graphs,
    }
    if kind == "eagle3":
        section.update(num_drafts=None, draft_vocab_size=cfg.draft_vocab_size)
    else:
        section.update(
            block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
            num_drafts=drafter.num_drafts, label_shift=drafter.label_shift,
        )
    if kind == "dspark":
        section.update(
            markov_rank=cfg.markov_rank, markov_variant=cfg.markov_variant,
            sts_temperatures=[float(t) for t in drafter.sts_temperatures],
        )
    section.update(extra or {})
    return section


def build_manifest(
    folder: Path,
    *,
    name: str,
    target_model,
    target_name: str,
    target_source: str | None,
    chat_template: str | None,
    graphs: list,
    drafter_info: dict[str, Any] | None,
    export_options: dict[str, Any],
) -> dict[str, Any]:
    """The manifest of a finished folder (graphs: ExportedGraph list; files hashed from disk)."""
    cfg = target_model.config
    config = _config_dict(cfg)
    custom: dict[str, list[str]] = {}
    graph_table = {}
    for g in graphs:
        graph_table[g.name] = {
            "file": g.path.name,
            "data": g.data_path.name if g.data_path else None,
            "description": g.description,
            "custom_ops": list(g.custom_ops),
            "inputs": g.inputs,
            "outputs": g.outputs,
            "runtime": getattr(g, "runtime", "any"),
        }
        for op in g.custom_ops:
            custom.setdefault(op, []).append(g.name)
    from specrt.plugins import onnx_ops

    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "export": export_options,
        "target": {
            "name": target_name,
            "source": target_source,
            "config": config,
            "tap_layers": list(target_model.tap_layers),
            "hidden_size": cfg.hidden_size,
            "num_layers": cfg.num_layers,
            "vocab_size": cfg.vocab_size,
            "eos_token_ids": list(cfg.eos_token_ids),
            "bos_token_id": cfg.bos_token_id,
            "chat_template": chat_template,
            "fingerprint": target_fingerprint(cfg),
            "kv_cache": {
                "layout": "one input pair per layer: past_key_{i}/past_value_{i} [batch, kv_heads, capacity, head_dim]",
                "dtype": export_options.get("dtype"),
                "num_kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "capacity": export_options.get("kv_capacity"),
            },
        },
        "drafter": drafter_info,
        "graphs": graph_table,
        "custom_ops": [
            {"domain": onnx_ops.DOMAIN, "name": op.split("::", 1)[1], "version": onnx_ops.DOMAIN_VERSION,
             "graphs": sorted(names)}
            for op, names in sorted(custom.items())
        ],
        "tokenizer": {"file": "tokenizer.json", "config": "tokenizer_config.json"},
        "files": files_table(folder),
    }
    return manifest


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    path = Path(folder) / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def record_files(folder: str | Path, names: list[str]) -> bool:
    """Record the checksums of files written into an exported folder after its manifest (calibration
    files); the manifest is replaced atomically. False (nothing done) when folder has no manifest."""
    import os

    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    for name in names:
        data["files"][_safe_relative(name, str(path))] = {"sha256": sha256_file(folder / name),
                                                          "bytes": (folder / name).stat().st_size}
    tmp = path.with_name(f".{MANIFEST}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return True


# -- loading ---------------------------------------------------------------------------------------
@dataclass
class EngineManifest:
    """A validated engines folder."""

    folder: Path
    data: dict[str, Any]

    @property
    def target_config(self) -> LlamaConfig:
        return LlamaConfig.from_dict(self.data["target"]["config"])

    @property
    def drafter_kind(self) -> str | None:
        drafter = self.data.get("drafter")
        return drafter["kind"] if drafter else None

    @property
    def drafter_config(self):
        drafter = self.data.get("drafter")
        return None if not drafter else _drafter_config(drafter, str(self.folder / MANIFEST))

    def graph_path(self, name: str) -> Path:
        if name not in self.data["graphs"]:
            raise SpecrtError(
                f"{self.folder / MANIFEST} has no graph '{name}' (it has: {', '.join(self.data['graphs'])})",
                "export the folder with the drafter that provides it",
            )
        return self.folder / self.data["graphs"][name]["file"]

    @property
    def graphs(self) -> dict[str, Any]:
        return self.data["graphs"]


def _drafter_config(section: dict[str, Any], source: str):
    from specrt.export.models.dflash import DFlashConfig
    from specrt.export.models.dspark import DSparkConfig
    from specrt.export.models.eagle3 import Eagle3Config

    classes = {"eagle3": Eagle3Config, "dflash": DFlashConfig, "dspark": DSparkConfig}
    kind = section.get("kind")
    if kind not in classes:
        raise SpecrtError(f"{source}: unknown drafter kind {kind!r}", f"use eagle3, dflash or dspark; {_REEXPORT}")
    try:
        return classes[kind].from_dict(section["config"])
    except (TypeError, KeyError, ValueError) as err:
        raise SpecrtError(f"{source}: the drafter config is malformed ({err})", _REEXPORT) from None


def _safe_relative(name: Any, source: str) -> str:
    if not isinstance(name, str) or not name:
        raise SpecrtError(f"{source}: a file entry is not a file name ({name!r})", _REEXPORT)
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name:
        raise SpecrtError(f"{source}: file entry {name!r} points outside the engine folder", _REEXPORT)
    return name


def _require(data: dict[str, Any], key: str, kind: type, where: str, source: str) -> Any:
    if not isinstance(data.get(key), kind):
        raise SpecrtError(f"{source}: {where}'{key}' is missing or malformed", _REEXPORT)
    return data[key]


def load_manifest(folder: str | Path, verify_checksums: bool = True) -> EngineManifest:
    """Read and validate engines/<name>/manifest.json; refuse anything this runtime cannot trust."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise SpecrtError(f"engine folder not found: {folder}",
                          "export one first: specrt export --drafter KIND")
    if not path.is_file():
        raise SpecrtError(f"{path} does not exist: {folder} is not an exported engine folder "
                          "(or its export did not finish)", _REEXPORT)
    source = str(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SpecrtError(f"{source} is not valid JSON ({err})", _REEXPORT) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SpecrtError(f"{source} is not a specrt engine manifest (expected \"format\": \"{FORMAT}\")", _REEXPORT)
    version = data.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise SpecrtError(
            f"{source} has format_version {version!r}; this specrt reads "
            f"{', '.join(str(v) for v in SUPPORTED_VERSIONS)}",
            "upgrade specrt to read it, or re-export the folder with this specrt "
            "(specrt export --drafter KIND --out FOLDER)",
        )
    files = _require(data, "files", dict, "", source)
    target = _require(data, "target", dict, "", source)
    graphs = _require(data, "graphs", dict, "", source)
    _require(target, "config", dict, "target.", source)
    tokenizer = _require(data, "tokenizer", dict, "", source)
    if "target" not in graphs:
        raise SpecrtError(f"{source} lists no target graph", _REEXPORT)

    # every referenced file must be listed, present and intact
    referenced = [tokenizer.get("file"), tokenizer.get("config")]
    for name, graph in graphs.items():
        if not isinstance(graph, dict):
            raise SpecrtError(f"{source}: graph '{name}' is malformed", _REEXPORT)
        referenced.append(graph.get("file"))
        if graph.get("data"):
            referenced.append(graph["data"])
    drafter = data.get("drafter")
    if drafter and isinstance(drafter.get("draft_vocab"), dict):
        referenced.append(drafter["draft_vocab"].get("file"))
    for name in referenced:
        name = _safe_relative(name, source)
        if name not in files:
            raise SpecrtError(f"{source}: {name} is used but has no checksum in \"files\"", _REEXPORT)
    for name in CALIBRATION_FILES:
        if name not in files and (folder / name).exists():
            raise SpecrtError(f"{folder / name} is read by the runtime but has no checksum in {source}",
                              f"delete it and re-run `specrt calibrate --engines {folder}` (which records its "
                              f"checksum), or {_REEXPORT} --overwrite")
    inside = folder.resolve()
    for name, entry in files.items():
        _safe_relative(name, source)
        file = folder / name
        real = file.resolve()  # follows symlinks, of the file and of folders on its path
        if not real.is_relative_to(inside):
            raise SpecrtError(f"{file} is a symlink to {real}, outside the engine folder",
                              f"copy the file into {folder} (the folder must hold what its checksums describe)")
        if not file.is_file():
            raise SpecrtError(f"{file} is missing from the engine folder (listed in {source})",
                              f"restore the file or {_REEXPORT}")
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            raise SpecrtError(f"{source}: the checksum entry of {name} is malformed", _REEXPORT)
        if verify_checksums:
            if "bytes" in entry and file.stat().st_size != entry["bytes"]:
                raise SpecrtError(
                    f"{file} is corrupt: {file.stat().st_size} bytes, the manifest says {entry['bytes']}",
                    f"copy the folder again or {_REEXPORT}",
                )
            actual = sha256_file(file)
            if actual != entry["sha256"]:
                raise SpecrtError(
                    f"{file} is corrupt: sha256 {actual[:16]}... does not match the manifest's "
                    f"{entry['sha256'][:16]}...",
                    f"copy the folder again or {_REEXPORT}",
                )

    # target and drafter must agree
    try:
        target_cfg = LlamaConfig.from_dict(target["config"])
    except (TypeError, ValueError, SpecrtError) as err:
        raise SpecrtError(f"{source}: the target config is malformed ({err})", _REEXPORT) from None
    if drafter:
        _check_drafter(drafter, target, target_cfg, graphs, source)
    return EngineManifest(folder, data)


def _check_drafter(drafter: dict[str, Any], target: dict[str, Any], target_cfg: LlamaConfig,
                   graphs: dict[str, Any], source: str) -> None:
    from specrt.export.checkpoints.drafters import check_fits_target

    cfg = _drafter_config(drafter, source)
    name = target.get("name") or "the target"
    try:
        check_fits_target(cfg, target_cfg)
    except SpecrtError as err:
        raise SpecrtError(f"{source}: the drafter does not fit {name}: {err.problem}",
                          f"export the drafter together with its own target; {_REEXPORT}") from None
    fingerprint = target_fingerprint(target_cfg)
    if drafter.get("target_fingerprint") != fingerprint or target.get("fingerprint") != fingerprint:
        raise SpecrtError(
            f"{source}: the {drafter.get('kind')} drafter was exported for another target "
            f"(target fingerprint {str(drafter.get('target_fingerprint'))[:12]}..., this folder's target "
            f"{name} has {fingerprint[:12]}...)",
            f"export the drafter together with its own target; {_REEXPORT}",
        )
    if list(target.get("tap_layers") or []) != list(cfg.tap_layers):
        raise SpecrtError(
            f"{source}: the target graph returns taps {target.get('tap_layers')}, the drafter reads {cfg.tap_layers}",
            _REEXPORT,
        )
    for role, graph in (drafter.get("graphs") or {}).items():
        if graph not in graphs:
            raise SpecrtError(f"{source}: the drafter's {role} graph '{graph}' is not in \"graphs\"", _REEXPORT)
    vocab = drafter.get("draft_vocab")
    if vocab is not None and (not isinstance(vocab, dict) or not isinstance(vocab.get("size"), int)
                              or not 1 <= vocab["size"] <= target_cfg.vocab_size):
        raise SpecrtError(f"{source}: the drafter's draft_vocab {vocab!r} is malformed (a file and a size in "
                          f"1..{target_cfg.vocab_size})", _REEXPORT)


__all__ = [
    "FORMAT", "FORMAT_VERSION", "MANIFEST", "EngineManifest", "build_manifest", "write_manifest", "load_manifest",
    "drafter_section", "target_fingerprint", "sha256_file", "files_table", "versions", "record_files",
    "CALIBRATION_FILES",
]
