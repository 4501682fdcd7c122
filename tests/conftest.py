"""Shared fixtures: the embedded default target (loaded once) and transformers' reference of it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

torch.manual_seed(0)


@pytest.fixture(scope="session")
def default_target():
    from specrt.export.checkpoints import load_target

    return load_target()


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own Llama, loaded from the same GGUF (it dequantizes with the same gguf package)."""
    transformers = pytest.importorskip("transformers")
    from specrt.export.default_model import find_default_gguf

    path = find_default_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer():
    transformers = pytest.importorskip("transformers")
    from specrt.export.default_model import find_default_gguf

    path = find_default_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def run_full(model, ids: torch.Tensor, capacity: int | None = None):
    """One causal forward over ids [B, T] with a fresh cache: (logits [B, T, V], taps)."""
    b, t = ids.shape
    k, v = model.new_cache(b, capacity or t)
    pos = torch.arange(t).expand(b, t)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, t, t)
    with torch.no_grad():
        return model(ids, pos, mask, k, v, pos)
