"""TensorRT backend: the plans of an engine folder (`specrt build --trt`) behind the models' call contracts.

    engines = load_trt_engines("engines/SmolLM2-135M-Instruct-eagle3")
    pipe = trt_pipeline(engines)                  # specrt.runtime.pipeline.Pipeline over TensorRT
    pipe.generate("Why is the sky blue?")

Same pattern as the ONNX Runtime backend (specrt.runtime.backends.ort_backend): each plan is wrapped
in `TrtGraph`, whose `run(feeds) -> outputs` has `OrtGraph`'s contract, so the exported graphs sit
behind the torch models' call contracts through the ORT backend's classes (`OrtTargetModel`,
`OrtEagle3Drafter`, `OrtBlockDrafter`) and the one speculative loop runs them unchanged.

Device buffers: the K/V caches are torch CUDA tensors [L, B, Hkv, C, D] allocated once; each
layer's [B, Hkv, C, D] view is bound to the plan by pointer (`set_tensor_address`), so TensorRT
reads the cache window in place and no step copies the cache. The graphs return the new tokens'
K/V and the Triton kernel `write_kv` writes them at their slots in one launch for all layers (K and
V) - the in-place write that keeps TreeAttention itself read-only (see its contract). Inputs are
moved to the GPU once per step; outputs are allocated from the shapes TensorRT infers.

Profiles: the plan records its optimization profiles ("step", "prefill"); each call selects the
first whose ranges hold its shapes (specrt.export.build.pick_profile). One execution context per
profile, so switching between prefill and decode never re-initializes a context.

CUDA graphs: with `cuda_graphs=True`, calls whose shapes stay fixed are captured once and replayed.
The cache window S grows every step, so a captured step binds the whole cache (S = capacity, the
extra slots masked off): one graph per (profile, input shapes) that replays for every decode step,
at the cost of reading masks over the full capacity. That pays off when launch overhead dominates
(small models, short capacities); it is off by default.

Compatibility: a plan is refused unless it was built on a GPU of this compute capability with this
TensorRT version (specrt.export.build.check_plan_compatible), with the command that rebuilds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from specrt.export.build import check_plan_compatible, pick_profile
from specrt.plugins.errors import SpecrtError
from specrt.export.manifest import EngineManifest, load_manifest
from specrt.runtime.backends.ort_models import (
    OrtBlockDrafter,
    OrtEagle3Drafter,
    OrtTargetModel,
    cache_feeds,
    read_draft_vocab,
    split_window_mask,
    write_new_kv,
)

if TYPE_CHECKING:  # annotations only: the module imports without TensorRT
    import tensorrt as trt

_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CACHE_PREFIXES = ("past_key_", "past_value_")
_NO_PLANS = "build them: specrt build --engines {folder} --trt"


def _torch_dtype(trt_dtype: Any) -> torch.dtype:
    import tensorrt as trt

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}
    if trt_dtype not in table:
        raise SpecrtError(f"a plan tensor has TensorRT type {trt_dtype}, which the backend does not bind",
                          "rebuild the plans with specrt build")
    return table[trt_dtype]


def device_identity() -> tuple[str, str]:
    """(compute capability "M.m", TensorRT version) of this machine."""
    from specrt.plugins.trt_api import tensorrt_version

    if not torch.cuda.is_available():
        raise SpecrtError("the TensorRT backend needs a CUDA GPU and none is visible",
                          "run on the GPU the plans were built for, or use the ONNX Runtime backend (CPU)")
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}", tensorrt_version()


class _Captured:
    """One CUDA graph of one execution-context call, with its static input and output buffers."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class TrtGraph:
    """A deserialized plan run on torch CUDA tensors, with `OrtGraph.run`'s contract."""

    def __init__(self, plan_path: Path, record: dict[str, Any], spec: dict[str, Any],
                 cuda_graphs: bool = False) -> None:
        import tensorrt as trt

        self.path = Path(plan_path)
        self.record = record
        self.spec = spec
        self.device = torch.device("cuda")
        self.cuda_graphs = cuda_graphs
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine(self.path.read_bytes())
        if engine is None:
            raise SpecrtError(f"TensorRT cannot deserialize {self.path}",
                              "rebuild the plans on this machine: specrt build --engines FOLDER --trt")
        self.engine: trt.ICudaEngine = engine
        self.profiles = list(record.get("profiles") or [])
        self.input_names: list[str] = []
        self.output_names: list[str] = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            mode = engine.get_tensor_mode(name)
            (self.input_names if mode == trt.TensorIOMode.INPUT else self.output_names).append(name)
        self._contexts: dict[int, trt.IExecutionContext] = {}
        self._captured: dict[tuple, _Captured] = {}
        self._stream = torch.cuda.Stream()

    def _context(self, profile: int) -> trt.IExecutionContext:
        if profile not in self._contexts:
            context = self.engine.create_execution_context()
            if context is None:
                raise SpecrtError(f"TensorRT could not create an execution context for {self.path.name}",
                                  "free GPU memory, or rebuild with smaller limits")
            context.set_optimization_profile_async(profile, self._stream.cuda_stream)
            self._contexts[profile] = context
        return self._contexts[profile]

    def _bind(self, context: trt.IExecutionContext, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Set shapes and input addresses; allocate the outputs from the inferred shapes."""
        for name in self.input_names:
            tensor = feeds[name]
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise SpecrtError(f"{self.path.name}: input {name} {tuple(tensor.shape)} is outside the plan's profile",
                                  "rebuild with larger limits (specrt build --trt --max-...)")
            context.set_tensor_address(name, tensor.data_ptr())
        outputs: dict[str, torch.Tensor] = {}
        for name in self.output_names:
            dims = context.get_tensor_shape(name)
            shape = tuple(int(dims[i]) for i in range(len(dims)))
            out = torch.empty(shape, dtype=_torch_dtype(self.engine.get_tensor_dtype(name)), device=self.device)
            outputs[name] = out
            context.set_tensor_address(name, out.data_ptr())
        return outputs

    def _prepare(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ready = {}
        for name in self.input_names:
            if name not in feeds:
                raise SpecrtError(f"{self.path.name} needs input {name}", "this is a bug in the caller: please report")
            tensor = feeds[name].to(self.device, non_blocking=True)
            ready[name] = tensor if tensor.is_contiguous() else tensor.contiguous()
        return ready

    def run(self, feeds: dict[str, torch.Tensor], outputs: list[str] | None = None) -> dict[str, torch.Tensor]:
        ready = self._prepare(feeds)
        profile = pick_profile(self.profiles, {k: tuple(v.shape) for k, v in ready.items()}) if self.profiles else 0
        context = self._context(profile)
        self._stream.wait_stream(torch.cuda.current_stream())  # the feeds were written on the caller's stream
        with torch.cuda.stream(self._stream):
            if self.cuda_graphs:
                results = self._replay(profile, context, ready)
            else:
                results = self._bind(context, ready)
                if not context.execute_async_v3(self._stream.cuda_stream):
                    raise SpecrtError(f"TensorRT failed to run {self.path.name}",
                                      "rerun with the ORT backend to compare")
        torch.cuda.current_stream().wait_stream(self._stream)
        wanted = outputs or self.output_names
        return {name: results[name] for name in wanted}

    def _replay(self, profile: int, context: trt.IExecutionContext,
                ready: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # the caches are bound by address (never copied): a graph is captured per set of cache buffers
        caches = {k: v.data_ptr() for k, v in ready.items() if k.startswith(CACHE_PREFIXES)}
        key = (profile, tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(ready.items())),
               tuple(sorted(caches.items())))
        captured = self._captured.get(key)
        if captured is None:
            static = {k: v if k in caches else v.clone() for k, v in ready.items()}
            outs = self._bind(context, static)
            context.execute_async_v3(self._stream.cuda_stream)  # warm-up: TensorRT allocates lazily
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self._stream):
                context.execute_async_v3(self._stream.cuda_stream)
            captured = self._captured[key] = _Captured(graph, static, outs)
        for name, tensor in ready.items():
            if name not in caches:  # small step inputs: copied into the captured buffers
                captured.inputs[name].copy_(tensor, non_blocking=True)
        captured.graph.replay()
        return {k: v.clone() for k, v in captured.outputs.items()}  # the next replay overwrites the static buffers


def write_kv_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
                  write_slots: torch.Tensor) -> None:
    """The Triton K/V row write on CUDA; torch's index_copy where Triton is missing."""
    try:
        from specrt.plugins.triton_tree_attention import write_kv
    except ImportError:  # pragma: no cover
        write_new_kv(k_cache, v_cache, new_keys, new_values, write_slots)
        return
    try:
        write_kv(k_cache, v_cache, new_keys, new_values, write_slots)
    except SpecrtError:
        write_new_kv(k_cache, v_cache, new_keys, new_values, write_slots)


class TrtTargetModel(OrtTargetModel):
    """The target plan with LlamaModel's call contract; new K/V rows go to the cache through Triton.

    With CUDA graphs on, the window is the whole cache (past_mask padded to capacity columns), so
    decode steps keep one shape and replay one captured graph.
    """

    def __init__(self, graph: TrtGraph, config: Any, tap_layers: list[int], cache_dtype: torch.dtype,
                 capacity: int, max_batch: int) -> None:
        super().__init__(graph, config, tap_layers, cache_dtype)
        self.trt_graph = graph
        self.max_capacity = int(capacity)
        self.max_batch = int(max_batch)

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None):
        if capacity > self.max_capacity or batch > self.max_batch:
            raise SpecrtError(
                f"the request needs a KV cache of {capacity} slots x batch {batch}; the TensorRT plans were built for "
                f"{self.max_capacity} x {self.max_batch}",
                "rebuild with specrt build --trt --capacity N --max-batch B, or ask for fewer tokens")
        return super().new_cache(batch, capacity, dtype)

    def __call__(self, input_ids, position_ids, attn_mask, k_cache, v_cache, write_slots, logit_rows=None):
        b, t = input_ids.shape
        if logit_rows is None:
            logit_rows = torch.arange(t).expand(b, t)
        past_mask, tree_mask = split_window_mask(attn_mask, write_slots)
        if self.trt_graph.cuda_graphs:
            capacity = k_cache.shape[3]
            past_mask = torch.nn.functional.pad(past_mask, (0, capacity - past_mask.shape[-1]))
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "past_mask": past_mask,
                 "tree_mask": tree_mask, "logit_rows": logit_rows, **cache_feeds(k_cache, v_cache)}
        out = self.trt_graph.run(feeds)
        write_kv_rows(k_cache, v_cache, out["new_keys"], out["new_values"], write_slots.to(k_cache.device))
        taps = out.get("taps") if self.tap_layers else None
        return out["logits"], taps


@dataclass
class TrtEngines:
    folder: Path
    manifest: EngineManifest
    target: TrtTargetModel
    drafter: Any  # OrtEagle3Drafter | OrtBlockDrafter | None (over TrtGraphs)
    drafter_kind: str | None
    tokenizer: Any

    @property
    def name(self) -> str:
        return str(self.manifest.data.get("name", self.folder.name))

    def proposer(self, options: Any = None) -> Any:
        from specrt.export.draft_options import from_manifest
        from specrt.runtime.proposers.factory import proposer_for

        if self.drafter is None or self.drafter_kind is None:
            return None
        return proposer_for(self.drafter_kind, self.drafter, options or from_manifest(self.manifest.data))


def plan_records(manifest: dict[str, Any], folder: Path) -> dict[str, dict[str, Any]]:
    section = manifest.get("tensorrt") or {}
    plans = section.get("plans") or {}
    if not plans:
        raise SpecrtError(f"{folder} has no TensorRT plans", _NO_PLANS.format(folder=folder))
    return plans


def load_trt_engines(folder: str | Path, with_drafter: bool = True, cuda_graphs: bool = False,
                     verify_checksums: bool = True) -> TrtEngines:
    """Validate the manifest and the plans' provenance, deserialize every plan, wrap the graphs."""
    from specrt.export.tokenizer import chat_tokenizer_from_folder
    from specrt.plugins.trt_api import require_tensorrt

    folder = Path(folder)
    manifest = load_manifest(folder, verify_checksums=verify_checksums)
    data = manifest.data
    plans = plan_records(data, folder)
    require_tensorrt()
    cc, version = device_identity()
    for record in plans.values():
        check_plan_compatible(record, cc, version, str(folder))
    if any(r.get("plugins") == "jit" for r in plans.values()):
        from specrt.plugins.trt_plugins import register_plugins

        register_plugins()  # JIT plugins call back into Python: their definitions must be registered
    dtype_name = (data.get("export") or {}).get("dtype", "float32")
    cache_dtype = _CACHE_DTYPES.get(dtype_name, torch.float32)
    limits = (data.get("tensorrt") or {}).get("limits") or {}

    def graph(name: str) -> TrtGraph:
        if name not in plans:
            raise SpecrtError(f"{folder} has no TensorRT plan for graph '{name}'", _NO_PLANS.format(folder=folder))
        return TrtGraph(folder / plans[name]["file"], plans[name], data["graphs"][name], cuda_graphs)

    target_cfg = manifest.target_config
    target = TrtTargetModel(graph("target"), target_cfg, list(data["target"].get("tap_layers", [])), cache_dtype,
                            int(limits.get("capacity", target_cfg.max_position_embeddings)),
                            int(limits.get("max_batch", 1)))
    drafter: Any = None
    kind = manifest.drafter_kind
    if with_drafter and kind:
        section = data["drafter"]
        cfg = manifest.drafter_config
        roles = section.get("graphs", {})
        if kind == "eagle3":
            ids = np.load(folder / (section.get("draft_vocab") or {}).get("file", "draft_to_target.npy"))
            drafter = OrtEagle3Drafter(graph(roles.get("fc", "eagle3_fc")),  # type: ignore[arg-type]
                                       graph(roles.get("step", "eagle3_step")), cfg, ids,  # type: ignore[arg-type]
                                       cache_dtype)
        else:
            drafter = OrtBlockDrafter(kind, graph(roles.get("ingest", f"{kind}_ingest")),  # type: ignore[arg-type]
                                      graph(roles.get("block", f"{kind}_block")), cfg,  # type: ignore[arg-type]
                                      cache_dtype, section.get("sts_temperatures"),
                                      read_draft_vocab(folder, section, int(target_cfg.vocab_size)))
    tokenizer = chat_tokenizer_from_folder(folder, list(target_cfg.eos_token_ids))
    return TrtEngines(folder, manifest, target, drafter, kind if drafter is not None else None, tokenizer)


def trt_pipeline(engines: TrtEngines | str | Path, draft_options: Any = None, cuda_graphs: bool = False) -> Any:
    """A specrt.runtime.pipeline.Pipeline over the TensorRT plans (backend "trt")."""
    from specrt.runtime.backends.torch_backend import TorchTargetEngine
    from specrt.runtime.pipeline import Pipeline

    if not isinstance(engines, TrtEngines):
        engines = load_trt_engines(engines, cuda_graphs=cuda_graphs)
    loaded = engines

    def factory(capacity: int, batch: int, spare_slots: int) -> TorchTargetEngine:
        # the cache (capacity + spare slots) must fit the plans' capacity dim
        usable = min(capacity, loaded.target.max_capacity - spare_slots)
        return TorchTargetEngine(loaded.target, usable, batch, spare_slots=spare_slots)  # type: ignore[arg-type]

    pipe = Pipeline(loaded.target, loaded.tokenizer, loaded.proposer(draft_options), loaded.name, "trt", factory)
    pipe.source = loaded.manifest.data["target"].get("source")
    return pipe


__all__ = ["TrtGraph", "TrtTargetModel", "TrtEngines", "load_trt_engines", "trt_pipeline", "write_kv_rows",
           "device_identity", "plan_records"]

