"""`load_target`: the model, its tokenizer and where they came from, whatever the checkpoint format."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specrt.export.default_model import DEFAULT_NAME, find_default_gguf
from specrt.plugins.errors import SpecrtError
from specrt.export.models.llama import LlamaModel
from specrt.export.tokenizer import ChatTokenizer, chat_tokenizer_from_folder, chat_tokenizer_from_gguf


@dataclass
class LoadedTarget:
    model: LlamaModel
    tokenizer: ChatTokenizer
    source: Path
    name: str
    load_seconds: float


def load_target(path: str | Path | None = None, dtype: torch.dtype = torch.float32) -> LoadedTarget:
    """Load an HF folder, a .gguf file, or (path None) the embedded default SmolLM2-135M-Instruct."""
    start = time.perf_counter()
    if path is None:
        path, name = find_default_gguf(), DEFAULT_NAME
    else:
        path = Path(path)
        name = path.stem if path.suffix == ".gguf" else path.name
    path = Path(path)
    if path.suffix == ".gguf" or path.is_file():
        from specrt.export.checkpoints.gguf_file import load_gguf

        if path.exists() and path.is_file() and path.suffix != ".gguf":
            raise SpecrtError(f"{path} is a file but not a .gguf", "pass a .gguf file or an HF checkpoint folder")
        model, meta = load_gguf(path, dtype)
        tokenizer = chat_tokenizer_from_gguf(meta, str(path))
    else:
        from specrt.export.checkpoints.hf import load_hf_folder

        model = load_hf_folder(path, dtype)
        tokenizer = chat_tokenizer_from_folder(path, model.config.eos_token_ids)
    for eos in tokenizer.eos_token_ids:
        if eos not in model.config.eos_token_ids:
            model.config.eos_token_ids.append(eos)
    return LoadedTarget(model, tokenizer, path, name, time.perf_counter() - start)
