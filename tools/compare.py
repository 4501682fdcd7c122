"""Run an exported graph in ONNX Runtime and its torch module on the same inputs; report differences.

    python -m specrt.tools.compare engines/NAME [--graph target --graph dspark_block ...]
        [--batch 2 --seq 6 --rows 3 --past 9 --capacity 24] [--seed 0] [--atol 1e-4 --rtol 1e-3]
        [--polygraphy | --no-polygraphy]

The torch side is the export wrapper of `specrt.export.onnx_export` rebuilt from the checkpoints the
manifest names (its eager custom ops are the torch references). Inputs follow each graph's contract,
not plain noise: a partly filled cache (rows of the batch with different lengths), a branching
tree mask (random parents, ancestor-or-self), positions = committed length + depth, token ids
inside the vocabulary, sorted logit rows, Gumbel noise and a decreasing SPS table. Integer outputs
(tokens, draft lengths) must match exactly; floats pass when |got - ref| <= atol + rtol*|ref|
elementwise (numpy.isclose), and every line also shows max|d| / max|ref|, the error against the
output's own scale (a 30-layer model's hidden states reach 1e4). When Polygraphy is installed (`pip install polygraphy`,
pure Python) its Comparator also judges the run and prints its report; the own comparison works
without it. Exit status: 0 when every output is within tolerance, 1 otherwise, 2 for bad input.

Library use (tests): `random_inputs(inputs, sizes, ...)`, `compare(onnx_path, module, feeds)`.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specrt.plugins.errors import SpecrtError

DEFAULT_SIZES = {"batch": 2, "seq": 6, "rows": 3, "past": 9, "capacity": 24, "sps_len": 12}
_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "bool": np.bool_}


@dataclass
class OutputDiff:
    name: str
    shape: tuple[int, ...]
    dtype: str
    max_abs: float
    max_rel: float
    scale_rel: float  # max|d| / max|ref|: the error against the output's own scale
    mismatches: int  # elements outside atol + rtol*|ref| (exact for integers)
    ok: bool

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        return (f"{status} {self.name:<14} {str(list(self.shape)):<22} {self.dtype:<8} max|d| {self.max_abs:.3e}  "
                f"max rel {self.max_rel:.3e}  max|d|/max|ref| {self.scale_rel:.1e}  mismatches {self.mismatches}")


def random_tree_mask(rng: np.random.Generator, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row a random tree over seq nodes (parent of i in -1..i-1): (mask [B, T, T], depth [B, T])."""
    mask = np.zeros((batch, seq, seq), dtype=np.bool_)
    depth = np.zeros((batch, seq), dtype=np.int64)
    for b in range(batch):
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, seq)]
        if seq > 2:
            parents[1] = parents[2] = 0 if b % 2 == 0 else parents[1]  # make sure some node branches
        for i, p in enumerate(parents):
            mask[b, i, i] = True
            depth[b, i] = 0 if p < 0 else depth[b, p] + 1
            a = p
            while a >= 0:
                mask[b, i, a] = True
                a = parents[a]
    return mask, depth


def random_inputs(
    inputs: Sequence[dict[str, Any]],
    sizes: dict[str, int] | None = None,
    vocab_size: int = 2,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Inputs for a graph from its manifest input list ([{name, dtype, shape}]) that respect its contract."""
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    rng = np.random.default_rng(seed)

    def resolve(shape) -> list[int]:
        return [d if isinstance(d, int) else sizes[d] for d in shape]

    by_name = {spec["name"]: spec for spec in inputs}
    batch = sizes["batch"]
    past = sizes["past"]
    lengths = np.array([past] + [int(rng.integers(max(past // 2, 0), past + 1)) for _ in range(batch - 1)])
    feeds: dict[str, np.ndarray] = {}
    new_len = None
    for key in ("input_ids", "block_ids", "taps"):
        if key in by_name:
            new_len = resolve(by_name[key]["shape"])[1]
            break
    tree, depth = random_tree_mask(rng, batch, new_len or 1)
    is_block = "block_ids" in by_name
    for spec in inputs:
        name, shape = spec["name"], resolve(spec["shape"])
        dtype = _NP_DTYPES[spec["dtype"]]
        if name in ("input_ids", "block_ids"):
            value = rng.integers(0, vocab_size, size=shape)
        elif name == "position_ids":
            steps = np.arange(shape[1])[None, :] if (is_block or "tree_mask" not in by_name) else depth
            value = lengths[:, None] + steps
        elif name == "past_mask":
            value = np.broadcast_to(np.arange(shape[2])[None, None, :] < lengths[:, None, None], shape).copy()
        elif name == "tree_mask":
            value = tree
        elif name == "logit_rows":
            value = np.stack([np.sort(rng.choice(new_len, size=shape[1], replace=False)) for _ in range(shape[0])])
        elif name == "temperature":
            value = np.where(np.arange(shape[0]) % 2 == 0, 0.0, 0.8)
        elif name == "gumbel":
            value = -np.log(-np.log(rng.uniform(1e-9, 1.0, size=shape)))
        elif name == "threshold":
            value = np.array(0.05)
        elif name == "sps":
            n = np.arange(shape[0])
            value = 100.0 / (1.0 + 0.05 * n)
        else:  # caches, taps, hidden
            value = rng.standard_normal(shape)
        feeds[name] = np.ascontiguousarray(value).astype(dtype)
    return feeds


def _diff(name: str, got: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> OutputDiff:
    if got.shape != ref.shape:
        return OutputDiff(name, tuple(got.shape), str(got.dtype), math.inf, math.inf, math.inf, -1, False)
    if not np.issubdtype(ref.dtype, np.floating):
        bad = int((got != ref).sum())
        worst = float(np.abs(got.astype(np.int64) - ref.astype(np.int64)).max(initial=0))
        return OutputDiff(name, tuple(got.shape), str(got.dtype), worst, 0.0, 0.0, bad, bad == 0)
    g, r = got.astype(np.float64), ref.astype(np.float64)
    d = np.abs(g - r)
    finite = np.isfinite(g) == np.isfinite(r)
    bad = int((~finite).sum() + (d > atol + rtol * np.abs(r))[np.isfinite(d)].sum())
    max_abs = float(np.nanmax(d, initial=0.0))
    max_rel = float(np.nanmax(d / np.maximum(np.abs(r), 1e-6), initial=0.0))
    scale = float(np.nanmax(np.abs(r), initial=0.0))
    scale_rel = max_abs / scale if scale > 0 else max_abs
    return OutputDiff(name, tuple(got.shape), str(got.dtype), max_abs, max_rel, scale_rel, bad, bad == 0)


def run_onnx(onnx_path: str | Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def run_torch(module, feeds: dict[str, np.ndarray], input_names: Sequence[str],
              output_names: Sequence[str]) -> dict[str, np.ndarray]:
    import torch

    args = [torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in input_names]
    with torch.no_grad():
        out = module.eval()(*args)
    out = out if isinstance(out, (tuple, list)) else (out,)
    return {name: t.detach().cpu().numpy() for name, t in zip(output_names, out)}


def compare(
    onnx_path: str | Path,
    module,
    feeds: dict[str, np.ndarray],
    input_names: Sequence[str],
    output_names: Sequence[str],
    atol: float = 1e-4,
    rtol: float = 1e-3,
    use_polygraphy: bool | None = None,
) -> tuple[list[OutputDiff], Any]:
    """(per-output differences ONNX Runtime vs torch, Polygraphy's verdict or None)."""
    got = run_onnx(onnx_path, feeds)
    ref = run_torch(module, feeds, input_names, output_names)
    diffs = [_diff(name, got[name], ref[name], atol, rtol) for name in output_names]
    verdict = None
    if use_polygraphy is not False:
        try:
            from polygraphy.comparator import Comparator, IterationResult, RunResults

            try:
                from polygraphy.comparator import SimpleCompareFunc
            except ImportError:  # Polygraphy < 0.50
                from polygraphy.comparator import CompareFunc

                SimpleCompareFunc = CompareFunc.simple
        except ImportError:
            if use_polygraphy:
                raise SpecrtError("Polygraphy is not installed",
                                  "pip install polygraphy (pure Python), or drop --polygraphy") from None
        else:
            results = RunResults()
            results.append(("onnxruntime", [IterationResult(got, runner_name="onnxruntime")]))
            results.append(("torch", [IterationResult(ref, runner_name="torch")]))
            verdict = bool(Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=atol, rtol=rtol)))
    return diffs, verdict


def torch_modules_for(engine) -> dict[str, Any]:
    """Rebuild the export wrappers of an engine folder from the checkpoints its manifest names."""
    import torch

    from specrt.export import onnx_export as ox
    from specrt.export.checkpoints import load_target
    from specrt.export.checkpoints.drafters import load_drafter

    data = engine.data
    dtype = ox.dtype_from_name(data["export"]["dtype"])
    target_source = data["target"].get("source")
    target = load_target(target_source, dtype)  # None: the embedded default
    drafter = None
    if data.get("drafter"):
        source = data["drafter"].get("source")
        if not source:
            raise SpecrtError(f"{engine.folder}: the drafter was exported from an in-memory model (no checkpoint path)",
                              "compare its graphs from Python with specrt.tools.compare.compare(...)")
        drafter = load_drafter(source, target.model.config, kind=data["drafter"]["kind"], dtype=dtype)
    with torch.no_grad():
        specs = ox.graph_specs(target.model, drafter, dtype)
    return {spec.name: spec for spec in specs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specrt-compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", help="engine folder (with manifest.json)")
    parser.add_argument("--graph", action="append", help="graph name (repeatable; default: all)")
    for dim, value in DEFAULT_SIZES.items():
        parser.add_argument(f"--{dim.replace('_', '-')}", type=int, default=value, help=f"size of dim '{dim}'")
    parser.add_argument("--block", type=int, default=None, help="DFlash block length (default: its block size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--rtol", type=float, default=1e-3)
    poly = parser.add_mutually_exclusive_group()
    poly.add_argument("--polygraphy", dest="polygraphy", action="store_true", default=None)
    poly.add_argument("--no-polygraphy", dest="polygraphy", action="store_false")
    args = parser.parse_args(argv)
    try:
        from specrt.export.manifest import load_manifest

        engine = load_manifest(args.engine)
        names = args.graph or list(engine.graphs)
        specs = torch_modules_for(engine)
        sizes = {d: getattr(args, d) for d in DEFAULT_SIZES}
        drafter = engine.data.get("drafter") or {}
        sizes["block"] = args.block or drafter.get("block_size") or 4
        worst = True
        for name in names:
            graph = engine.graphs.get(name)
            if graph is None:
                raise SpecrtError(f"{engine.folder} has no graph '{name}'", f"choose from {', '.join(engine.graphs)}")
            feeds = random_inputs(graph["inputs"], sizes, engine.data["target"]["vocab_size"], args.seed)
            diffs, verdict = compare(
                engine.graph_path(name), specs[name].module, feeds, [i["name"] for i in graph["inputs"]],
                [o["name"] for o in graph["outputs"]], args.atol, args.rtol, args.polygraphy,
            )
            print(f"== {name} ({engine.graph_path(name).name})" + ("" if verdict is None else
                                                                   f"  polygraphy: {'PASS' if verdict else 'FAIL'}"))
            for d in diffs:
                print("   " + d.line())
            worst = worst and all(d.ok for d in diffs) and verdict is not False
        return 0 if worst else 1
    except SpecrtError as err:
        print(f"compare: error: {err.problem}", file=sys.stderr)
        if err.fix:
            print(f"  fix: {err.fix}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
