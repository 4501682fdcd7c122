"""Ahead-of-time compilation of specrt's Triton kernels to PTX, for TensorRT's AOT plugins.

    kernel = compile_kernel(fn, signature, constexprs, target=(90, 32))   # CompiledKernel
    kernel.name, kernel.ptx, kernel.num_warps, kernel.shared              # what tensorrt.plugin wants

TensorRT's `@trtp.aot_impl` returns (kernel name, PTX, launch parameters, extra int32 arguments) and
TensorRT launches the kernel itself with the arguments in one fixed order: every input pointer,
then the extra scalars, then every output pointer. specrt's kernels are declared in exactly that
order (see each kernel's signature), so nothing is reordered.

Triton >= 3.3 appends hidden parameters to every kernel (`global_scratch`, and since 3.5
`profile_scratch`), which TensorRT does not pass. A kernel that needs no scratch memory never reads
them, so `trim_hidden_params` removes them from the PTX entry's parameter list - after checking
that the compiled metadata asks for zero scratch bytes and that the body never loads those
parameters. Anything else is refused with a SpecrtError rather than shipped as an engine that reads
garbage pointers. The trimmed PTX is what the tests assemble with the ptxas bundled in the triton
wheel, so this path is checked on machines without a GPU.

Compilation needs no GPU: the target (compute capability, warp size) is given, so the build machine
could even produce PTX for another GPU; TensorRT still JIT-compiles that PTX for the device that
builds the engine. `ptx_version` (env SPECRT_PTX_VERSION, e.g. 83 for CUDA 12.3) caps the PTX ISA
version for older drivers (JetPack 6 ships CUDA 12.2: PTX 8.2).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from specrt.plugins.errors import SpecrtError

HIDDEN_PARAMS = ("global_scratch", "profile_scratch")


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    ptx: str
    num_warps: int
    shared: int
    params: int  # parameters of the PTX entry after trimming (== the signature's non-constexpr arguments)

    @property
    def block_x(self) -> int:
        return self.num_warps * 32


def _entry(ptx: str, name: str) -> tuple[int, int, list[str]]:
    """(start, end) of the parameter list of `.entry name(...)` and its parameter declarations."""
    match = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(", ptx)
    if match is None:
        raise ValueError(f"no .entry {name} in the PTX")
    start = match.end()
    end = ptx.index(")", start)
    params = [p.strip() for p in ptx[start:end].split(",") if p.strip()]
    return start, end, params


def entry_params(ptx: str, name: str) -> list[str]:
    """The declared parameters of the kernel entry (one `.param ...` string each)."""
    return _entry(ptx, name)[2]


def trim_hidden_params(ptx: str, name: str, expected: int, metadata: Any = None) -> str:
    """Drop Triton's trailing hidden scratch parameters so the entry takes exactly `expected` params."""
    start, end, params = _entry(ptx, name)
    extra = len(params) - expected
    if extra == 0:
        return ptx
    if extra < 0 or extra > len(HIDDEN_PARAMS):
        raise SpecrtError(f"the PTX of {name} declares {len(params)} parameters, the kernel signature has {expected}",
                          "this Triton version is not supported for TensorRT AOT plugins: install triton 3.2-3.9")
    for field in ("global_scratch_size", "profile_scratch_size"):
        if metadata is not None and int(getattr(metadata, field, 0) or 0) != 0:
            raise SpecrtError(f"the Triton kernel {name} needs {field}={getattr(metadata, field)}, which TensorRT "
                              "does not allocate",
                              "report this as a specrt bug (the kernels are written without scratch)")
    body = ptx[end:]
    for decl in params[expected:]:
        param_name = decl.split()[-1]
        if re.search(re.escape(param_name) + r"\b", body):
            raise SpecrtError(f"the Triton kernel {name} reads its hidden parameter {param_name}",
                              "use a Triton version whose kernels need no scratch pointer (triton<=3.2) "
                              "for AOT plugins")
    return ptx[:start] + "\n\t" + ",\n\t".join(params[:expected]) + "\n" + ptx[end:]


def driver_ptx_version() -> int | None:
    """The newest PTX ISA the installed CUDA driver JIT-compiles (None when there is no driver)."""
    import ctypes

    try:
        from triton.backends.nvidia.compiler import ptx_get_version

        version = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
        return int(ptx_get_version(f"{version.value // 1000}.{(version.value % 1000) // 10}"))
    except Exception:  # no driver, or a Triton without the helper: keep Triton's default
        return None


def _ptx_version(for_this_device: bool) -> int | None:
    value = os.environ.get("SPECRT_PTX_VERSION")
    if not value:
        # TensorRT hands the PTX to the driver's JIT: never emit an ISA newer than the driver reads
        return driver_ptx_version() if for_this_device else None
    try:
        return int(value)
    except ValueError:
        raise SpecrtError(f"SPECRT_PTX_VERSION={value!r} is not a number", "set it like 83 (PTX ISA 8.3)") from None


def current_target() -> tuple[int, int]:
    """(compute capability as major*10+minor, warp size) of the current CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise SpecrtError("no CUDA device to compile the Triton kernels for",
                          "build TensorRT engines on the GPU that runs them")
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor, 32


def compile_kernel(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
                   target: tuple[int, int] | None = None, num_warps: int = 4) -> CompiledKernel:
    """Compile a @triton.jit kernel for a CUDA target to PTX, trimmed to its declared parameters.

    signature: every parameter in order, "*fp32"/"*fp16"/"*bf16"/"*i1"/"*i64"/"i32" or "constexpr".
    """
    import triton
    from triton.backends.compiler import GPUTarget

    arch, warp = target or current_target()
    full = dict(signature)
    for key in constexprs:
        full[key] = "constexpr"
    options: dict[str, Any] = {"num_warps": num_warps}
    version = _ptx_version(target is None)
    if version is not None:
        options["ptx_version"] = version
    src = triton.compiler.ASTSource(fn=fn, signature=full, constexprs=dict(constexprs))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, warp), options=options)
    md = compiled.metadata
    expected = sum(1 for t in full.values() if t != "constexpr")
    ptx = trim_hidden_params(compiled.asm["ptx"], md.name, expected, md)
    return CompiledKernel(md.name, ptx, int(md.num_warps), int(md.shared), expected)


TORCH_TO_TRITON = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "bool": "i1", "int64": "i64",
                   "int32": "i32"}


__all__ = ["CompiledKernel", "compile_kernel", "trim_hidden_params", "entry_params", "current_target",
           "TORCH_TO_TRITON", "HIDDEN_PARAMS"]
