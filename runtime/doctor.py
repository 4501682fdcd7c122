"""`specrt doctor`: what this machine can run, and where the default model is.

Every probe is guarded: a missing or broken package is reported, never raised. Run it as
`specrt doctor` or `python -m specrt.runtime.doctor`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
from typing import Callable


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _probe(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as err:  # a doctor reports, it does not crash
        return f"unavailable ({type(err).__name__}: {err})"


def _torch() -> str:
    import torch

    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no CUDA device"
    return f"{torch.__version__} ({cuda}; {torch.get_num_threads()} threads)"


def _gpus() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none visible to torch"
    names = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        names.append(f"{torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    return ", ".join(names)


def _onnxruntime() -> str:
    ort = importlib.import_module("onnxruntime")
    return f"{ort.__version__}; providers: {', '.join(ort.get_available_providers())}"


def _tensorrt() -> str:
    trt = importlib.import_module("tensorrt")
    return f"{trt.__version__}"


def _triton() -> str:
    triton = importlib.import_module("triton")
    interp = " (TRITON_INTERPRET=1: CPU interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return f"{triton.__version__}{interp}"


def _default_model() -> str:
    from specrt.export.default_model import INSTALL_HINT, find_default_gguf

    path = find_default_gguf(required=False)
    if path is None:
        return f"not installed (run: {INSTALL_HINT})"
    return f"{path} ({path.stat().st_size / 1e6:.1f} MB)"


def _huge_pages() -> str:
    from specrt.runtime.backends.huge_pages import THP_MODE_FILE, thp_mode

    mode = thp_mode()
    if mode is None:
        return "not offered by this system (engines run on 4 KiB pages)"
    if mode == "never":
        return (f"off: engines run on 4 KiB pages, measured 4-12% slower decoding on a CPU "
                f"(as root: echo madvise > {THP_MODE_FILE})")
    return f"transparent huge pages: {mode} (engine weights move onto 2 MiB pages after loading)"


def report() -> list[tuple[str, str]]:
    rows = [
        ("python", f"{platform.python_version()} on {platform.machine()} ({os.cpu_count()} CPUs)"),
        ("specrt", _version("specrt") or "not installed as a package"),
        ("torch", _probe(_torch)),
        ("GPU", _probe(_gpus)),
        ("onnx", _version("onnx") or "not installed (pip install 'specrt[onnx]')"),
        ("onnxruntime", _probe(_onnxruntime) if _version("onnxruntime") or _version("onnxruntime-gpu") else "not installed (pip install 'specrt[onnx]')"),
        ("TensorRT", _probe(_tensorrt) if _version("tensorrt") else "not installed (NVIDIA GPUs only: pip install tensorrt)"),
        ("triton", _probe(_triton) if _version("triton") else "not installed (GPU kernels; pip install triton)"),
        ("huge pages", _probe(_huge_pages)),
        ("nvidia-smi", shutil.which("nvidia-smi") or "not found"),
        ("default model", _probe(_default_model)),
    ]
    return rows


def main() -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="specrt doctor", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    for name, value in report():
        table.add_row(Text(name), Text(value))  # Text: package extras like [onnx] are not markup
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
