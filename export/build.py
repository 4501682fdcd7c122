"""`specrt build --engines engines/NAME --trt`: TensorRT plans for every graph of an exported engine folder.

    specrt build --engines engines/NAME --trt [--fp16 | --bf16] [--no-plugins] [--timing-cache PATH]
                 [--max-batch N] [--max-prefill N] [--max-step N] [--capacity N] [--plugin-lib PATH]

What it does, per graph of the manifest (target, drafter graphs):
 1. Plugins (default): a copy of the ONNX graph whose `specrt` nodes carry `plugin_namespace="specrt"`
    (and `aot=1`) is parsed, so TensorRT's ONNX parser imports each node as the `tensorrt.plugin`
    plugin of the same name (specrt.plugins.trt_plugins: Triton kernels compiled ahead of time and
    embedded in the plan) instead of inlining the model-local function. `--no-plugins` parses the
    graph as exported, so the parser inlines the function bodies (standard ops only): the path for
    JetPack 6's TensorRT 10.3, which has no Python plugins, and for comparing the two.
 2. Optimization profiles from the manifest's symbolic shapes (`graph_profiles`): a "step" profile
    for decode / verify / draft steps (seq <= --max-step) and a "prefill" profile (seq <=
    --max-prefill); the cache window `past` ranges over 0..capacity, `capacity` over 1..capacity,
    `batch` over 1..--max-batch; fixed dims (a DSpark block) stay fixed. The runtime picks the first
    profile whose ranges hold a call's shapes.
 3. A timing cache (default FOLDER/timing.cache) is loaded and saved, so rebuilds are fast.
 4. Each plan is written as FOLDER/<graph>.plan and recorded in manifest.json (`tensorrt` section
    and the checksum table) with the GPU's compute capability and the TensorRT version; the runtime
    refuses a plan built for another GPU or TensorRT (`check_plan_compatible`), because TensorRT
    plans are not portable across either.

Everything that needs no TensorRT (limits, profiles, the plugin rewrite of the ONNX graph, plugin
coverage, manifest records, compatibility) is a pure function tested without TensorRT; the builder
calls themselves are type-checked against tensorrt-stubs. Bad input is a SpecrtError (exit code 2).
Polygraphy is not used: the builder API is a dozen calls and is typed by tensorrt-stubs, while
Polygraphy's loaders are untyped; `polygraphy inspect model FOLDER/target.plan` works on the output.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from specrt.plugins.errors import SpecrtError

DIM_NAMES = ("batch", "seq", "rows", "past", "capacity", "block", "sps_len")
PROFILE_KINDS = ("step", "prefill")
TIMING_CACHE = "timing.cache"
PLAN_SUFFIX = ".plan"
REBUILD = "rebuild the plans on this machine: specrt build --engines {folder} --trt"
_NO_DIM_FIX = "re-export the folder with this specrt (specrt export ...), or upgrade specrt"


# -- pure planning ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """The shape envelope the plans are built for."""

    max_batch: int = 1
    max_prefill: int = 512
    max_step: int = 16
    capacity: int = 2048
    block: int | None = None  # DFlash / DSpark block size (a fixed dim)

    def validate(self) -> Limits:
        for name in ("max_batch", "max_prefill", "max_step", "capacity"):
            if int(getattr(self, name)) < 1:
                raise SpecrtError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}",
                                  "pass a positive value")
        if self.max_prefill > self.capacity or self.max_step > self.capacity:
            raise SpecrtError(f"--max-prefill {self.max_prefill} / --max-step {self.max_step} exceed the KV capacity "
                              f"{self.capacity}", "lower them or raise --capacity")
        return self


@dataclass
class Profile:
    name: str
    shapes: dict[str, tuple[list[int], list[int], list[int]]] = field(default_factory=dict)  # input -> min/opt/max

    def holds(self, shapes: dict[str, Sequence[int]]) -> bool:
        """True when every given input shape lies inside this profile's ranges."""
        for name, shape in shapes.items():
            if name not in self.shapes:
                continue
            low, _, high = self.shapes[name]
            if len(shape) != len(low) or any(not lo <= s <= hi for s, lo, hi in zip(shape, low, high)):
                return False
        return True


def default_max_step(manifest: dict[str, Any]) -> int:
    """Tokens of one verify / draft step: the drafter's tree or block, 16 when unknown (target-only: 16)."""
    drafter = manifest.get("drafter") or {}
    tree = drafter.get("tree") or {}
    candidates = [16]
    if tree.get("total_tokens"):
        candidates.append(int(tree["total_tokens"]))
    if drafter.get("block_size"):
        candidates.append(int(drafter["block_size"]) + 1)
    # copied drafts are grafted onto the drafter's tree (specrt.runtime.proposers.lookup)
    extra = int((drafter.get("lookup") or {}).get("max_tokens") or 0)
    return max(candidates) + extra


def resolve_limits(manifest: dict[str, Any], max_batch: int | None = None, max_prefill: int | None = None,
                   max_step: int | None = None, capacity: int | None = None) -> Limits:
    """Limits from the flags, defaulting to the manifest (KV capacity, drafter step size)."""
    target = manifest.get("target") or {}
    recorded = (target.get("kv_cache") or {}).get("capacity") or (manifest.get("export") or {}).get("kv_capacity")
    limit = int((target.get("config") or {}).get("max_position_embeddings") or 2048)
    cap = int(capacity if capacity is not None else min(int(recorded or limit), 4096))
    if cap > limit:
        raise SpecrtError(f"--capacity {cap} exceeds the target's max_position_embeddings {limit}",
                          f"pass --capacity <= {limit}")
    drafter = manifest.get("drafter") or {}
    block = int(drafter["block_size"]) if drafter.get("block_size") else None
    step = int(max_step if max_step is not None else min(default_max_step(manifest), cap))
    prefill = int(max_prefill if max_prefill is not None else min(512, cap))
    return Limits(int(max_batch or 1), prefill, step, cap, block).validate()


def dim_ranges(kind: str, limits: Limits) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every named dim in a profile of this kind."""
    if kind not in PROFILE_KINDS:
        raise ValueError(kind)
    seq_max = limits.max_step if kind == "step" else limits.max_prefill
    seq_opt = limits.max_step if kind == "step" else min(128, limits.max_prefill)
    past_opt = min(limits.capacity, 512)
    ranges = {
        "batch": (1, 1, limits.max_batch),
        "seq": (1, seq_opt, seq_max),
        "rows": (1, seq_opt if kind == "step" else 1, seq_max),
        "past": (0, past_opt, limits.capacity),
        "capacity": (1, limits.capacity, limits.capacity),
        "sps_len": (1, 1, limits.max_batch * (limits.block or limits.max_step) + 1),
    }
    if limits.block is not None:
        ranges["block"] = (limits.block, limits.block, limits.block)
    return ranges


def graph_profiles(graph_name: str, graph: dict[str, Any], limits: Limits) -> list[Profile]:
    """Optimization profiles of one manifest graph: "step" (+ "prefill" when it has a seq dim)."""
    inputs = graph.get("inputs") or []
    names = {d for i in inputs for d in i.get("shape", []) if isinstance(d, str)}
    unknown = sorted(names - set(DIM_NAMES))
    if unknown:
        raise SpecrtError(f"graph '{graph_name}' has dimensions this builder does not know: {', '.join(unknown)}",
                          _NO_DIM_FIX)
    if "block" in names and limits.block is None:
        raise SpecrtError(f"graph '{graph_name}' has a block dimension but the manifest records no block size",
                          _NO_DIM_FIX)
    kinds = ["step", "prefill"] if "seq" in names else ["step"]
    profiles = []
    for kind in kinds:
        ranges = dim_ranges(kind, limits)
        profile = Profile(kind)
        for spec in inputs:
            lo, opt, hi = [], [], []
            for d in spec["shape"]:
                a, b, c = (d, d, d) if isinstance(d, int) else ranges[d]
                lo.append(a)
                opt.append(b)
                hi.append(c)
            profile.shapes[spec["name"]] = (lo, opt, hi)
        profiles.append(profile)
    return profiles


def check_confidence_limits(manifest: dict[str, Any], limits: Limits, plugins: bool) -> None:
    """The ConfidenceTruncate plugin is compiled for at most AOT_BLOCK candidates (batch x block)."""
    if not plugins:
        return
    from specrt.plugins.triton_confidence_truncate import AOT_BLOCK

    uses = any("specrt::ConfidenceTruncate" in (g.get("custom_ops") or []) for g in manifest.get("graphs", {}).values())
    if uses and limits.max_batch * (limits.block or 1) > AOT_BLOCK:
        raise SpecrtError(f"--max-batch {limits.max_batch} x block {limits.block} exceeds the {AOT_BLOCK} candidates "
                          "the ConfidenceTruncate plugin is compiled for",
                          "lower --max-batch, or build with --no-plugins")


# -- plugins ------------------------------------------------------------------------------------------
def check_plugin_libs(paths: Iterable[str | Path]) -> list[Path]:
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise SpecrtError(f"plugin library {path} does not exist",
                              "pass the path of a built TensorRT plugin library (.so), or drop --plugin-lib")
        out.append(path)
    return out


def check_plugin_coverage(graph_name: str, custom_ops: Sequence[str], available: Iterable[str]) -> None:
    """Every specrt op of the graph must have a plugin when building with plugins."""
    have = set(available)
    missing = [op for op in custom_ops if op not in have]
    if missing:
        raise SpecrtError(
            f"graph '{graph_name}' uses {', '.join(missing)}, for which no TensorRT plugin is registered "
            f"(registered: {', '.join(sorted(have)) or 'none'})",
            "build with --no-plugins to inline the ops' ONNX function bodies, or load a plugin library "
            "that provides them with --plugin-lib PATH",
        )


def plugin_model(model: Any, aot: bool = True) -> list[str]:
    """Mark the specrt nodes of an onnx.ModelProto (in place) for TensorRT's plugin importer.

    plugin_namespace="specrt" makes the parser prefer a registered plugin over the local function;
    aot=1 selects the ahead-of-time implementation. Returns the op types marked.
    """
    from onnx import helper
    from specrt.plugins.onnx_ops import DOMAIN

    marked: list[str] = []
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        keep = [a for a in node.attribute if a.name not in ("plugin_namespace", "aot")]
        del node.attribute[:]
        node.attribute.extend(keep)
        node.attribute.append(helper.make_attribute("plugin_namespace", DOMAIN))
        if aot:
            node.attribute.append(helper.make_attribute("aot", 1))
        marked.append(node.op_type)
    return marked


def write_plugin_graph(source: Path, aot: bool = True) -> Path:
    """A marked copy of an ONNX file beside it (so its external data still resolves); caller deletes it."""
    import onnx

    model = onnx.load(str(source), load_external_data=False)
    plugin_model(model, aot)
    fd, name = tempfile.mkstemp(prefix=f".{source.stem}.plugins-", suffix=".onnx", dir=str(source.parent))
    os.close(fd)
    onnx.save(model, name)
    return Path(name)


# -- manifest records -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    name: str
    compute_capability: str  # "9.0"


def plan_record(graph: str, plan_file: str, profiles: list[Profile], device: Device, trt_version: str,
                precision: str, plugins: str, seconds: float) -> dict[str, Any]:
    return {
        "graph": graph,
        "file": plan_file,
        "compute_capability": device.compute_capability,
        "device": device.name,
        "tensorrt_version": trt_version,
        "precision": precision,
        "plugins": plugins,  # "aot" | "jit" | "none"
        "profiles": [{"name": p.name, "shapes": {k: [list(x) for x in v] for k, v in p.shapes.items()}}
                     for p in profiles],
        "build_seconds": round(seconds, 1),
    }


def record_plans(manifest: dict[str, Any], records: dict[str, dict[str, Any]], files: dict[str, dict[str, Any]],
                 limits: Limits, timing_cache: str | None) -> dict[str, Any]:
    """A copy of the manifest with the plans recorded (`tensorrt` section + their checksums)."""
    data = json.loads(json.dumps(manifest))
    section = data.get("tensorrt") or {"plans": {}}
    section["plans"] = {**section.get("plans", {}), **records}
    section["limits"] = asdict(limits)
    section["timing_cache"] = timing_cache
    section["built"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    data["tensorrt"] = section
    data.setdefault("files", {}).update(files)
    return data


def check_plan_compatible(record: dict[str, Any], compute_capability: str, trt_version: str,
                          folder: str = "FOLDER") -> None:
    """Refuse a plan built for another GPU or TensorRT: TensorRT plans are portable across neither."""
    built_cc, built_trt = str(record.get("compute_capability")), str(record.get("tensorrt_version"))
    graph = record.get("graph", "?")
    if built_cc != str(compute_capability):
        raise SpecrtError(
            f"the TensorRT plan of graph '{graph}' was built for a GPU of compute capability {built_cc} "
            f"({record.get('device')}); this GPU has {compute_capability}", REBUILD.format(folder=folder))
    if built_trt != str(trt_version):
        raise SpecrtError(
            f"the TensorRT plan of graph '{graph}' was built with TensorRT {built_trt}; this machine has {trt_version}",
            REBUILD.format(folder=folder))


def pick_profile(profiles: Sequence[dict[str, Any] | Profile], shapes: dict[str, Sequence[int]]) -> int:
    """Index of the first profile whose ranges hold the call's input shapes (recorded or Profile objects)."""
    for i, p in enumerate(profiles):
        prof = p if isinstance(p, Profile) else Profile(p["name"], {k: tuple(v) for k, v in p["shapes"].items()})
        if prof.holds(shapes):
            return i
    dims = ", ".join(f"{k} {list(v)}" for k, v in shapes.items())
    raise SpecrtError(f"no optimization profile of the TensorRT plan holds this call ({dims})",
                      "rebuild with larger limits: specrt build --trt --max-batch/--max-prefill/--max-step/--capacity")


# -- the TensorRT build (needs TensorRT and a GPU) ---------------------------------------------------
@dataclass
class BuildOptions:
    precision: str = "fp32"  # fp32 | fp16 | bf16 (fp16/bf16 let TensorRT pick reduced-precision kernels)
    plugins: str = "aot"  # aot | jit | none
    timing_cache: Path | None = None
    workspace_mib: int | None = None
    verbose: bool = False


def current_device() -> Device:
    import torch

    if not torch.cuda.is_available():
        raise SpecrtError("no CUDA GPU is visible: TensorRT plans are built on the GPU that runs them",
                          "run specrt build on the target machine (for Jetson: on the device itself)")
    major, minor = torch.cuda.get_device_capability()
    return Device(torch.cuda.get_device_name(), f"{major}.{minor}")


def _logger(verbose: bool) -> Any:
    import tensorrt as trt

    return trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)


def build_plan(onnx_path: Path, profiles: list[Profile], options: BuildOptions) -> bytes:
    """Parse one ONNX graph, add the profiles, build and return the serialized plan."""
    import tensorrt as trt

    logger = _logger(options.verbose)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SpecrtError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors[:600]}",
                          "check the TensorRT version (10.x), or build with --no-plugins to inline the specrt ops")
    config = builder.create_builder_config()
    if options.precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif options.precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    if options.workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_mib) << 20)
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for profile in profiles:
        trt_profile = builder.create_optimization_profile()
        for name, (low, opt, high) in profile.shapes.items():
            if name in inputs:  # the parser drops inputs no node reads
                trt_profile.set_shape(name, trt.Dims(low), trt.Dims(opt), trt.Dims(high))
        config.add_optimization_profile(trt_profile)
    cache_path = options.timing_cache
    cache_bytes = cache_path.read_bytes() if cache_path is not None and cache_path.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=True)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SpecrtError(f"TensorRT could not build a plan for {onnx_path.name} (see the log above)",
                          "rerun with --verbose; try --no-plugins or smaller limits")
    if cache_path is not None:
        cache_path.write_bytes(bytes(memoryview(config.get_timing_cache().serialize())))
    return bytes(memoryview(serialized))


def _register(options: BuildOptions, plugin_libs: list[Path]) -> set[str]:
    """Register specrt's plugins (+ libraries); the plugin ids TensorRT now knows in namespace specrt."""
    import tensorrt as trt
    from specrt.plugins.trt_plugins import register_plugins

    available = set(register_plugins())
    registry = trt.get_plugin_registry()
    for lib in plugin_libs:
        registry.load_library(str(lib))
    for creator in registry.all_creators:
        if getattr(creator, "plugin_namespace", "") == "specrt":
            available.add(f"specrt::{creator.name}")
    return available


def build_engines(folder: str | Path, limits: Limits | None = None, options: BuildOptions | None = None,
                  graphs: Sequence[str] | None = None, plugin_libs: Sequence[str | Path] = (),
                  limit_overrides: dict[str, int | None] | None = None) -> dict[str, Any]:
    """Build plans for the folder's graphs and record them; returns the new manifest data."""
    from specrt.export.manifest import files_table, load_manifest, sha256_file
    from specrt.plugins.trt_api import require_tensorrt, tensorrt_version

    options = options or BuildOptions()
    folder = Path(folder)
    manifest = load_manifest(folder)
    data = manifest.data
    limits = limits or resolve_limits(data, **(limit_overrides or {}))
    # graphs on ONNX Runtime contrib ops (target_ort) are ORT's own fast path, not TensorRT input
    names = list(graphs or [n for n, g in data["graphs"].items() if g.get("runtime", "any") != "onnxruntime"])
    for name in names:
        if name not in data["graphs"]:
            raise SpecrtError(f"{folder} has no graph '{name}' (it has: {', '.join(data['graphs'])})",
                              "pass --graphs with names from the manifest")
        if data["graphs"][name].get("runtime", "any") == "onnxruntime":
            raise SpecrtError(f"graph '{name}' uses ONNX Runtime contrib ops, which TensorRT cannot build",
                              "leave it out of --graphs (the portable 'target' graph is the TensorRT input)")
    plans = {name: graph_profiles(name, data["graphs"][name], limits) for name in names}
    use_plugins = options.plugins != "none"
    check_confidence_limits(data, limits, use_plugins)
    libs = check_plugin_libs(plugin_libs)
    if options.timing_cache is not None and not options.timing_cache.parent.is_dir():
        raise SpecrtError(f"--timing-cache {options.timing_cache}: folder {options.timing_cache.parent} does not exist",
                          "create the folder, or leave --timing-cache out (default: FOLDER/timing.cache)")
    require_tensorrt()
    available = _register(options, libs) if use_plugins else set()
    for name in names:
        if use_plugins:
            check_plugin_coverage(name, data["graphs"][name].get("custom_ops") or [], available)
    device = current_device()
    version = tensorrt_version()
    if options.timing_cache is None:
        options.timing_cache = folder / TIMING_CACHE
    records, files = {}, {}
    for name in names:
        start = time.perf_counter()
        source = manifest.graph_path(name)
        parsed = write_plugin_graph(source, options.plugins == "aot") if use_plugins else source
        try:
            plan = build_plan(parsed, plans[name], options)
        finally:
            if parsed != source:
                parsed.unlink(missing_ok=True)
        plan_file = f"{name}{PLAN_SUFFIX}"
        tmp = folder / f".{plan_file}.tmp"
        tmp.write_bytes(plan)
        os.replace(tmp, folder / plan_file)
        records[name] = plan_record(name, plan_file, plans[name], device, version, options.precision, options.plugins,
                                    time.perf_counter() - start)
        files[plan_file] = {"sha256": sha256_file(folder / plan_file), "bytes": len(plan)}
        print(f"built {plan_file} ({len(plan) / 2**20:.1f} MB, {records[name]['build_seconds']} s)", file=sys.stderr)
    cache_name = None
    if options.timing_cache is not None and options.timing_cache.parent.resolve() == folder.resolve():
        cache_name = options.timing_cache.name
    new = record_plans(data, records, files, limits, cache_name)
    if cache_name and (folder / cache_name).is_file():
        new["files"].update({k: v for k, v in files_table(folder).items() if k == cache_name})
    _write_manifest_atomic(folder, new)
    return new


def _write_manifest_atomic(folder: Path, data: dict[str, Any]) -> None:
    from specrt.export.manifest import MANIFEST

    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, folder / MANIFEST)


# -- CLI ------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", required=True, help="engine folder written by `specrt export`")
    p.add_argument("--trt", action="store_true", help="build TensorRT plans (the only engine kind that needs a build)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="allow float16 kernels")
    precision.add_argument("--bf16", action="store_true", help="allow bfloat16 kernels")
    p.add_argument("--no-plugins", action="store_true",
                   help="inline the specrt ops' ONNX function bodies (TensorRT without Python plugins, e.g. JetPack 6)")
    p.add_argument("--plugin-mode", default="aot", choices=("aot", "jit"),
                   help="aot: kernels embedded in the plan (default); jit: Python callbacks at run time")
    p.add_argument("--plugin-lib", action="append", default=[], help="extra TensorRT plugin library (.so) to load")
    p.add_argument("--timing-cache", default=None, help=f"timing cache file (default: FOLDER/{TIMING_CACHE})")
    p.add_argument("--graphs", default=None, help="comma-separated graph names (default: all)")
    p.add_argument("--max-batch", type=int, default=None, help="largest batch (default 1)")
    p.add_argument("--max-prefill", type=int, default=None, help="longest prefill chunk (default 512)")
    p.add_argument("--max-step", type=int, default=None, help="tokens per verify/draft step (default: the drafter's)")
    p.add_argument("--capacity", type=int, default=None, help="KV cache slots (default: the manifest's, at most 4096)")
    p.add_argument("--workspace", type=int, default=None, help="builder workspace limit in MiB")
    p.add_argument("--verbose", action="store_true", help="TensorRT's verbose log")


def run(args: argparse.Namespace) -> int:
    if not args.trt:
        raise SpecrtError("specrt build makes TensorRT plans: pass --trt",
                          "ONNX Runtime needs no build step: specrt generate --engines FOLDER")
    options = BuildOptions(
        precision="fp16" if args.fp16 else "bf16" if args.bf16 else "fp32",
        plugins="none" if args.no_plugins else args.plugin_mode,
        timing_cache=Path(args.timing_cache) if args.timing_cache else None,
        workspace_mib=args.workspace, verbose=args.verbose,
    )
    graphs = [g.strip() for g in args.graphs.split(",") if g.strip()] if args.graphs else None
    overrides = {"max_batch": args.max_batch, "max_prefill": args.max_prefill, "max_step": args.max_step,
                 "capacity": args.capacity}
    data = build_engines(args.engines, None, options, graphs, args.plugin_lib, overrides)
    print(f"{args.engines}: {len(data['tensorrt']['plans'])} TensorRT plan(s) recorded in manifest.json",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from specrt.plugins.errors import run_reporting_errors

    parser = argparse.ArgumentParser(prog="specrt build", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_reporting_errors("specrt build", lambda: run(args))


__all__ = [
    "Limits", "Profile", "Device", "BuildOptions", "resolve_limits", "dim_ranges", "graph_profiles",
    "check_plugin_libs", "check_plugin_coverage", "plugin_model", "write_plugin_graph", "plan_record", "record_plans",
    "check_plan_compatible", "pick_profile", "build_plan", "build_engines", "add_arguments", "run", "main",
]

if __name__ == "__main__":
    raise SystemExit(main())
