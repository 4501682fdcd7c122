"""One weights file per engine folder: every graph's tensors, each distinct byte string stored once.

An engine folder holds several graphs over the same weights: the portable target, the ORT-fused
target (the same layers, with q|k|v and gate|up packed into one matrix each: specrt.export.ort_fused)
and the drafter graphs (EAGLE-3's step reads the target's embedding). Saved on its own, each graph
carries a copy of every weight it reads. `share_weights(folder, graphs)` rewrites the graphs so
that all of their initializers live in one external-data file, WEIGHTS_FILE, beside them:

- each distinct byte string is written once (keyed by the sha256 of the tensor's raw bytes; dtype
  and dims stay in each graph, so a head tied to the embedding shares its bytes whatever it is called);
- a packed tensor (a constant input of a node marked PARTS_KEY, such as the fused graph's q|k|v
  MatMul, before or after quantization) whose parts along one axis are each already in the file is
  stored as those parts, and a Concat node in front of its consumers rebuilds it. ONNX Runtime folds
  that Concat into a constant when it loads the graph (constant folding runs at every optimization
  level but "disabled"), so the session runs the same kernels on the same bytes as before;
- tensors of at least ALIGN_FROM bytes start at a multiple of ALIGNMENT, the layout ONNX Runtime's
  own saver uses so that its CPU provider can map them from the file instead of copying them;
- tensors under INLINE_BELOW bytes stay inside their graph (shape constants that onnx's checker and
  shape inference read).

Every graph names WEIGHTS_FILE as its external data by a path relative to the graph file, so ONNX
Runtime, onnx.load and TensorRT's parser load each graph from the folder as it is. The manifest lists
the file once, with its sha256, as the `data` of every graph that reads it, and the runtime refuses a
corrupted weights file by name before any session loads (specrt.export.manifest.load_manifest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

WEIGHTS_FILE = "weights.data"
INLINE_BELOW = 1024
ALIGN_FROM = 1 << 20
ALIGNMENT = 4096
# node metadata: the widths (comma-separated) of the parts a packed weight concatenates along its
# output dim (written by specrt.export.ort_fused, carried over quantization by specrt.export.quantize)
PARTS_KEY = "specrt.parts"


@dataclass
class SharingSummary:
    graphs: int
    tensors: int  # initializers written to the weights file, over all graphs
    stored: int  # distinct byte strings among them
    packed_as_parts: int  # packed tensors stored as parts another graph already holds
    tensor_bytes: int  # the graphs' external tensors added up: what separate files would hold
    file_bytes: int  # the weights file

    def note(self) -> str:
        return (f"{self.stored} distinct of {self.tensors} tensors in {self.graphs} graphs "
                f"({self.packed_as_parts} packed ones stored as their parts): "
                f"{self.file_bytes / 2**20:.1f} MB instead of {self.tensor_bytes / 2**20:.1f} MB")


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class _WeightsFile:
    """The weights file being written: appends a byte string unless it holds it already."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.ranges: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length)
        self.size = 0

    def holds(self, raw: bytes) -> bool:
        return _digest(raw) in self.ranges

    def put(self, raw: bytes) -> tuple[int, int]:
        digest = _digest(raw)
        if digest not in self.ranges:
            if len(raw) >= ALIGN_FROM and self.size % ALIGNMENT:
                pad = ALIGNMENT - self.size % ALIGNMENT
                self.file.write(b"\0" * pad)
                self.size += pad
            self.ranges[digest] = (self.size, len(raw))
            self.file.write(raw)
            self.size += len(raw)
        return self.ranges[digest]


def _parts(node) -> list[int] | None:
    for prop in node.metadata_props:
        if prop.key == PARTS_KEY:
            return [int(w) for w in prop.value.split(",")]
    return None


def _split_into_held_parts(array: np.ndarray, widths: list[int], store: _WeightsFile):
    """(axis, parts) when `array` is the concatenation of parts of these relative widths along some
    axis and the weights file already holds every part's bytes (but those small enough to stay
    inline); None otherwise."""
    total = sum(widths)
    for axis, size in enumerate(array.shape):
        if size % total:
            continue
        scale = size // total
        bounds = np.cumsum([w * scale for w in widths])[:-1]
        parts = [np.ascontiguousarray(p) for p in np.split(array, bounds, axis=axis)]
        held = [p.nbytes >= INLINE_BELOW and store.holds(p.tobytes()) for p in parts]
        # a part under INLINE_BELOW stays inside this graph, as it does inside the graph it comes from
        if any(held) and all(h or p.nbytes < INLINE_BELOW for h, p in zip(held, parts)):
            return axis, parts
    return None


def _store_packed_as_parts(model, store: _WeightsFile) -> int:
    """Replace each packed initializer whose parts the file already holds by a Concat of those parts."""
    from onnx import helper, numpy_helper

    initializers = {t.name: t for t in model.graph.initializer}
    replaced = 0
    for node in list(model.graph.node):
        widths = _parts(node)
        if not widths:
            continue
        for name in list(node.input):
            if name not in initializers:
                continue
            found = _split_into_held_parts(numpy_helper.to_array(initializers[name]), widths, store)
            if found is None:
                continue
            axis, parts = found
            names = [f"{name}.part{j}" for j in range(len(parts))]
            model.graph.initializer.remove(initializers.pop(name))
            model.graph.initializer.extend(numpy_helper.from_array(p, n) for p, n in zip(parts, names))
            # first in the node list: its inputs are all initializers, so the order stays topological
            model.graph.node.insert(0, helper.make_node("Concat", names, [name], name=f"{name}.pack", axis=axis))
            replaced += 1
    return replaced


def _externalize(model, store: _WeightsFile) -> tuple[int, int]:
    """Point every initializer of INLINE_BELOW bytes or more at its range of the weights file."""
    from onnx import TensorProto
    from onnx.external_data_helper import set_external_data

    count = nbytes = 0
    for tensor in model.graph.initializer:
        if not tensor.HasField("raw_data") or len(tensor.raw_data) < INLINE_BELOW:
            continue
        offset, length = store.put(tensor.raw_data)
        set_external_data(tensor, WEIGHTS_FILE, offset=offset, length=length)
        tensor.data_location = TensorProto.EXTERNAL
        tensor.ClearField("raw_data")
        count += 1
        nbytes += length
    return count, nbytes


def share_weights(folder: Path, graphs: Sequence) -> SharingSummary:
    """Rewrite the graphs (specrt.export.onnx_export.ExportedGraph, all in `folder`) to keep their
    initializers in folder/WEIGHTS_FILE, each distinct tensor once; their own data files are removed
    and each graph's `data_path` is updated. Portable graphs go first, so that the ORT-only graphs'
    packed tensors find their parts."""
    import onnx

    folder = Path(folder)
    path = folder / WEIGHTS_FILE
    if path.exists():
        raise FileExistsError(f"{path} exists already")  # an exporter bug, never a user's folder
    tensors = packed = tensor_bytes = 0
    with open(path, "wb") as file:
        store = _WeightsFile(file)
        for graph in sorted(graphs, key=lambda g: getattr(g, "runtime", "any") != "any"):
            model = onnx.load(str(graph.path), load_external_data=True)
            packed += _store_packed_as_parts(model, store)
            count, nbytes = _externalize(model, store)
            tensors += count
            tensor_bytes += nbytes
            graph.path.write_bytes(model.SerializeToString())
            del model
            if graph.data_path is not None and Path(graph.data_path) != path:
                Path(graph.data_path).unlink()
            graph.data_path = path if count else None
    if not store.ranges:
        path.unlink()
    return SharingSummary(len(graphs), tensors, len(store.ranges), packed, tensor_bytes, store.size)


def _all_tensors(graph):
    """Initializers and node-attribute tensors of a graph and its subgraphs."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for sub in attr.graphs:
                yield from _all_tensors(sub)


def external_files(graph_path: Path) -> set[str]:
    """The external-data files a graph reads (locations relative to its folder), without reading them."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(str(graph_path), load_external_data=False)
    return {ExternalDataInfo(t).location for t in _all_tensors(model.graph) if uses_external_data(t)}


__all__ = ["PARTS_KEY", "WEIGHTS_FILE", "SharingSummary", "external_files", "share_weights"]
