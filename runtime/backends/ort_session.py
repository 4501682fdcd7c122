"""One ONNX Runtime session per exported graph, fed and read through IO binding without copies.

    graph = OrtGraph(path, spec, options)          # spec: the manifest's entry for the graph
    outputs = graph.run({"input_ids": ids, ...})   # torch tensors in, torch tensors out

Why IO binding: the K/V caches are the runtime's own torch buffers ([B, Hkv, C, D] per layer,
hundreds of MB at long capacities). `session.run` with numpy feeds would be fine for small inputs,
but binding by pointer guarantees that nothing copies the cache: ORT reads the window the
attention needs straight out of the runtime's memory. Outputs whose shape follows from the inputs'
(all of specrt's graphs: every output dim is an int or a dim named on some input) are bound to
torch tensors allocated here, so results land in torch memory directly; an output whose shape
cannot be resolved is left to ORT and converted afterwards.

Execution providers (`--device`): cpu -> CPUExecutionProvider; cuda -> CUDAExecutionProvider (then
CPU for the ops it lacks); tensorrt -> TensorrtExecutionProvider, CUDA, CPU. A provider that this
onnxruntime build lacks is refused with the package that has it. On CUDA the tensors passed in
must live on the GPU (the backend allocates its caches there), and outputs are allocated there.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specrt.plugins.errors import SpecrtError
from specrt.runtime.backends.huge_pages import back_with_huge_pages

DEVICE_PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
                 torch.int32: np.int32, torch.bool: np.bool_}


@dataclass
class SessionOptions:
    device: str = "cpu"
    threads: int | None = None  # intra-op threads; None: ORT's default (one per physical core)
    optimization: str = "all"  # basic | extended | all
    profile: bool = False
    # pool threads spin between kernels instead of sleeping: a decode call runs ~400 small kernels, and
    # waking a sleeping thread for each costs ~25% of a one-token int4 call on 2 idle cores. None:
    # load_engines decides per graph (`spinning_policy`)
    spinning: bool | None = None
    # CPU: after a session loads, the process's large anonymous memory (its prepacked weights among
    # it) moves onto 2 MiB pages, 4-12% more plain-decoding tokens per second (huge_pages.py)
    huge_pages: bool = True

    def __post_init__(self) -> None:
        if self.device not in DEVICE_PROVIDERS:
            raise SpecrtError(f"unknown device {self.device!r}", f"use --device {' or '.join(DEVICE_PROVIDERS)}")
        if self.threads is not None and self.threads < 1:
            raise SpecrtError(f"--threads must be >= 1, got {self.threads}", "pass a positive thread count")

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu" if self.device == "cpu" else "cuda")


def check_providers(device: str) -> list[str]:
    import onnxruntime as ort

    wanted = DEVICE_PROVIDERS[device]
    available = ort.get_available_providers()
    if wanted[0] not in available:
        raise SpecrtError(
            f"--device {device} needs ONNX Runtime's {wanted[0]}, which this onnxruntime "
            f"({ort.__version__}: {', '.join(available)}) does not have",
            "install onnxruntime-gpu (pip install 'specrt[gpu]') on a machine with CUDA, or use --device cpu",
        )
    return wanted


def _session_options(opts: SessionOptions):
    import onnxruntime as ort

    so = ort.SessionOptions()
    levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    so.graph_optimization_level = levels[opts.optimization]
    if opts.threads:
        so.intra_op_num_threads = int(opts.threads)
    # spinning only when asked (see SessionOptions.spinning and ort_backend.spinning_policy)
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if opts.spinning else "0")
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.enable_profiling = opts.profile
    return so


class OrtGraph:
    """An InferenceSession over one manifest graph, run on torch tensors."""

    def __init__(self, path: Path, spec: dict[str, Any], options: SessionOptions) -> None:
        import onnxruntime as ort

        self.path = Path(path)
        self.spec = spec
        self.options = options
        self.device = options.torch_device
        providers = check_providers(options.device)
        if not self.path.is_file():
            raise SpecrtError(f"graph file {self.path} is missing", "re-export the engine folder (specrt export ...)")
        try:
            self.session = ort.InferenceSession(str(self.path), _session_options(options), providers=providers)
        except Exception as err:  # ORT raises its own exception types with the reason in the text
            raise SpecrtError(f"ONNX Runtime cannot load {self.path}: {str(err).splitlines()[0][:300]}",
                              "re-export the engine folder with this specrt (specrt export ...), "
                              "or upgrade onnxruntime") from None
        # what the last back_with_huge_pages did, None where it was not asked (SessionOptions.huge_pages)
        self.huge_pages = back_with_huge_pages() if options.huge_pages and options.device == "cpu" else None
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._in_shapes = {i["name"]: i["shape"] for i in spec.get("inputs", [])}
        self._out_specs = {o["name"]: o for o in spec.get("outputs", [])}
        # one IO binding per `binding` key of run(), created on first use and reused (see run)
        self._bindings: dict = {}
        self._device_type = "cpu" if self.device.type == "cpu" else "cuda"
        self._device_id = 0 if self.device.index is None else int(self.device.index)
        # time inside ONNX Runtime (run_with_iobinding) and its calls, for the graph/host split of a step
        self.run_seconds = 0.0
        self.run_calls = 0

    def _named_dims(self, name: str, shape) -> tuple[tuple[str, int], ...]:
        """(declared name, actual size) of an input's symbolic dimensions."""
        return tuple((declared, int(actual)) for declared, actual in zip(self._in_shapes.get(name, []), shape)
                     if isinstance(declared, str))

    def _output_buffer(self, name: str, dims: dict[str, int]) -> torch.Tensor | None:
        spec = self._out_specs.get(name)
        if spec is None or spec.get("dtype") not in _TORCH_DTYPES:
            return None
        shape = []
        for d in spec["shape"]:
            if isinstance(d, int):
                shape.append(d)
            elif d in dims:
                shape.append(dims[d])
            else:
                return None
        return torch.empty(shape, dtype=_TORCH_DTYPES[spec["dtype"]], device=self.device)

    def run_bound(self, binding) -> None:
        """Run an IO binding the caller bound itself (`specrt.runtime.backends.ort_decode`), timed."""
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.run_seconds += time.perf_counter() - start
        self.run_calls += 1

    def drop_bindings(self) -> None:
        """Forget every IO binding (and the buffers they hold alive), e.g. once a cache is replaced."""
        self._bindings.clear()

    def run(self, feeds: dict[str, torch.Tensor], outputs: list[str] | None = None,
            bound: dict[str, torch.Tensor] | None = None, binding: object = None) -> dict[str, torch.Tensor]:
        """Run the graph; `outputs` limits what is returned (the rest is still computed by ORT);
        `bound` gives outputs their memory (e.g. present_key_i bound to the cache it updates in place);
        `binding` names the IO binding to use: callers that alternate between buffers (one per cache
        row, say) keep one binding each, so none of them re-binds its buffers every call."""
        # one binding per key, reused: a name is re-bound only when its pointer, shape or dtype
        # changed, so the per-layer cache buffers (the same memory every step) cost nothing per call
        state = self._bindings.get(binding)
        if state is None:
            if len(self._bindings) >= 64:  # keys of caches since dropped: they hold their memory alive
                self._bindings.clear()
            # last: name -> (pointer, shape, dtype) bound. same: name -> the tensor object bound last
            # call, when it was bound as given; handed the same object again, run() skips it: ~60 cache
            # views per target call (measured: 0.77 -> 0.69 ms of Python per int4 decode step).
            # Holding the reference keeps its memory alive; nothing in specrt resizes a tensor in place.
            state = self._bindings[binding] = (self.session.io_binding(), {}, {}, {})
        binding, last, same, feed_dims = state
        keep = []  # contiguous copies must outlive the run
        dims: dict[str, int] = {}
        for name in self.input_names:
            tensor = feeds[name]
            if same.get(name) is tensor:
                # the very tensor bound last call (the per-layer cache views): nothing to check or bind
                for declared, actual in feed_dims[name]:
                    dims.setdefault(declared, actual)
                continue
            original = tensor
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            if tensor.device != self.device:
                tensor = tensor.to(self.device)
            keep.append(tensor)
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if last.get(name) != key:
                binding.bind_input(name, self._device_type, self._device_id, _NUMPY_DTYPES[tensor.dtype],
                                   list(tensor.shape), tensor.data_ptr())
                last[name] = key
            named = self._named_dims(name, tensor.shape)
            for declared, actual in named:
                dims.setdefault(declared, actual)
            if tensor is original:
                # bound as it is: next call may skip it if handed the same object (see _same)
                same[name], feed_dims[name] = tensor, named
            else:
                same.pop(name, None)
        results: dict[str, torch.Tensor] = {}
        unbound = []
        for name in self.output_names:
            given = bound.get(name) if bound else None  # caller's memory (the cache it updates in place)
            if given is not None and same.get(("out", name)) is given:
                results[name] = given
                continue
            buffer = given if given is not None else self._output_buffer(name, dims)
            if buffer is None:
                binding.bind_output(name, self._device_type, self._device_id)
                last.pop(("out", name), None)
                same.pop(("out", name), None)
                unbound.append(name)
                continue
            results[name] = buffer
            key = (buffer.data_ptr(), tuple(buffer.shape), buffer.dtype)
            if last.get(("out", name)) != key:
                binding.bind_output(name, self._device_type, self._device_id, _NUMPY_DTYPES[buffer.dtype],
                                    list(buffer.shape), buffer.data_ptr())
                last[("out", name)] = key
            if given is not None:
                same[("out", name)] = given
            else:
                same.pop(("out", name), None)
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.run_seconds += time.perf_counter() - start
        self.run_calls += 1
        if unbound:
            values = binding.get_outputs()
            for name, value in zip(self.output_names, values):
                if name in unbound:
                    results[name] = torch.from_numpy(value.numpy()).to(self.device)
        del keep
        wanted = outputs or self.output_names
        return {name: results[name] for name in wanted}


def default_threads() -> int:
    """Physical cores ORT would use; reported by the bench (os.cpu_count counts logical CPUs)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class LazyGraph:
    """An OrtGraph whose session is created on first use: an engine folder's portable target graph is
    only needed for batches when the ORT-fused graph serves single streams (each holds the weights)."""

    def __init__(self, path: Path, spec: dict[str, Any], options: SessionOptions) -> None:
        self.path, self.spec, self.options = Path(path), spec, options
        self.device = options.torch_device
        if not self.path.is_file():
            raise SpecrtError(f"graph file {self.path} is missing", "re-export the engine folder (specrt export ...)")
        self._graph: OrtGraph | None = None

    @property
    def loaded(self) -> bool:
        return self._graph is not None

    def run(self, feeds: dict[str, torch.Tensor], outputs: list[str] | None = None,
            bound: dict[str, torch.Tensor] | None = None, binding: object = None) -> dict[str, torch.Tensor]:
        if self._graph is None:
            self._graph = OrtGraph(self.path, self.spec, self.options)
        return self._graph.run(feeds, outputs, bound, binding)
