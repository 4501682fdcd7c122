"""Guarded access to TensorRT, and the part of `tensorrt.plugin` specrt relies on, as typed protocols.

    require_tensorrt()             # SpecrtError(problem, fix) when TensorRT cannot be imported
    import tensorrt as trt         # then import it where it is used, so mypy types it from tensorrt-stubs
    trtp = load_plugin_api()       # tensorrt.plugin (TensorRT >= 10.8), typed as PluginAPI

Why protocols: `tensorrt-stubs` types the `tensorrt` bindings but not the pure-Python
`tensorrt.plugin` module. Declaring here, in one place, exactly which of its names and signatures
specrt uses (from TensorRT's plugin guide and the `tensorrt.plugin` reference) lets mypy check every
call in specrt.plugins.trt_plugins against them; the real module is cast to `PluginAPI` once. The
unit tests run the plugin definitions against a small fake that implements the same protocols.

Nothing here imports TensorRT at module import time, so every module that uses it can be imported
(and its pure functions tested) on machines without TensorRT.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Iterable, Protocol, Sequence, TypeVar, cast

from specrt.plugins.errors import SpecrtError

F = TypeVar("F", bound=Callable[..., Any])

INSTALL_FIX = ("install TensorRT 10.x for your CUDA (x86_64: pip install tensorrt-cu12; Jetson: it ships with "
               "JetPack), or run the engines with ONNX Runtime: specrt generate --engines FOLDER")


class SymExpr(Protocol):
    """tensorrt.plugin.ShapeExpr / SymInt32: symbolic int arithmetic, resolved by TensorRT at run time."""

    def __add__(self, other: int | SymExpr) -> SymExpr: ...
    def __sub__(self, other: int | SymExpr) -> SymExpr: ...
    def __mul__(self, other: int | SymExpr) -> SymExpr: ...
    def __floordiv__(self, other: int | SymExpr) -> SymExpr: ...
    @property
    def is_constant(self) -> bool: ...
    def constant_value(self) -> int: ...


class ShapeExprsLike(Protocol):
    def __getitem__(self, index: int) -> SymExpr: ...
    def __len__(self) -> int: ...


class TensorDescLike(Protocol):
    shape_expr: ShapeExprsLike
    dtype: Any  # tensorrt.DataType

    def like(self) -> TensorDescLike: ...


class TensorLike(Protocol):
    """A plugin tensor at enqueue time; torch reads it through __cuda_array_interface__."""

    dtype: Any

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...


class KernelLaunchParamsLike(Protocol):
    grid_x: int | SymExpr
    grid_y: int | SymExpr
    grid_z: int | SymExpr
    block_x: int | SymExpr
    block_y: int | SymExpr
    block_z: int | SymExpr
    shared_mem: int | SymExpr


class SymIntExprsFactory(Protocol):
    def from_tuple(self, exprs: Sequence[SymExpr]) -> Any: ...


class PluginAPI(Protocol):
    """The subset of `tensorrt.plugin` used by specrt (names and call shapes as documented for 10.8+)."""

    TensorDesc: type
    Tensor: type
    KernelLaunchParams: Callable[[], KernelLaunchParamsLike]
    SymIntExprs: SymIntExprsFactory

    def register(self, plugin_id: str, lazy_register: bool = False) -> Callable[[F], F]: ...
    def impl(self, plugin_id: str) -> Callable[[F], F]: ...
    def aot_impl(self, plugin_id: str) -> Callable[[F], F]: ...
    def autotune(self, plugin_id: str) -> Callable[[F], F]: ...
    def AutoTuneCombination(self, io_types: str | None = None, layouts: str | None = None,
                            tactics: Iterable[int] | None = None) -> Any: ...
    def SymInt32(self, value: int | SymExpr) -> SymExpr: ...
    def cdiv(self, first: int | SymExpr, second: int | SymExpr) -> SymExpr: ...
    def from_shape_expr(self, shape_expr: ShapeExprsLike | tuple[int | SymExpr, ...], dtype: Any) -> TensorDescLike: ...


def tensorrt_available() -> bool:
    try:
        require_tensorrt()
    except SpecrtError:
        return False
    return True


def require_tensorrt() -> None:
    """Raise SpecrtError unless a working tensorrt module can be imported."""
    _load()


def _load() -> ModuleType:
    """The tensorrt module; SpecrtError when it is missing or is PyPI's placeholder package."""
    try:
        trt = importlib.import_module("tensorrt")
    except ImportError as err:
        raise SpecrtError(f"TensorRT is not installed (import tensorrt: {err})", INSTALL_FIX) from None
    except Exception as err:  # a broken install (missing libnvinfer, no CUDA driver) raises other errors
        raise SpecrtError(f"TensorRT cannot be loaded ({type(err).__name__}: {str(err)[:200]})", INSTALL_FIX) from None
    if not hasattr(trt, "Builder"):
        # e.g. PyPI's placeholder, or only tensorrt-stubs (whose folder imports as an empty namespace package)
        raise SpecrtError("TensorRT is not installed: the importable `tensorrt` has no Builder (a placeholder, "
                          "type stubs only, or a partial install)", INSTALL_FIX)
    return trt


def tensorrt_version() -> str:
    return str(_load().__version__)


def load_plugin_api() -> PluginAPI:
    """tensorrt.plugin (Python-defined plugins, TensorRT >= 10.7; ahead-of-time kernels need >= 10.8)."""
    trt = _load()
    try:
        module = importlib.import_module("tensorrt.plugin")
    except ImportError:
        raise SpecrtError(
            f"TensorRT {trt.__version__} has no Python plugin module (tensorrt.plugin, TensorRT 10.7+); JetPack 6 "
            "ships TensorRT 10.3",
            "build from the ONNX function bodies instead: specrt build --engines FOLDER --trt --no-plugins",
        ) from None
    if not hasattr(module, "aot_impl"):
        raise SpecrtError(f"TensorRT {trt.__version__}'s tensorrt.plugin has no aot_impl (TensorRT 10.8+), so the "
                          "kernels cannot be embedded in the engine",
                          "upgrade TensorRT to 10.8+, or build with --no-plugins")
    return cast(PluginAPI, module)


__all__ = ["PluginAPI", "TensorDescLike", "TensorLike", "SymExpr", "ShapeExprsLike", "KernelLaunchParamsLike",
           "require_tensorrt",
           "load_plugin_api", "tensorrt_available", "tensorrt_version", "INSTALL_FIX"]
