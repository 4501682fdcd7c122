"""Shared fixtures: the embedded default target (loaded once) and transformers' reference of it."""

from __future__ import annotations

import os

import pytest
import torch

torch.manual_seed(0)

# pytest-xdist (pyproject's addopts: `-n auto --dist loadfile`) runs one worker per core; the ONNX
# export tests are single-threaded Python tracing, so they overlap well. Give each worker its share
# of the cores so the numeric tests do not oversubscribe them (OpenMP threads spin while waiting).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, _cores // _workers))


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


_REAL_MODEL_FIXTURES = {"default_target", "hf_default_model", "hf_default_tokenizer"}


def pytest_collection_modifyitems(config, items):
    """The longest files run first: `slow` ones (export and run the real model), then the files
    that load the real model, then the rest.

    Under xdist's `--dist loadfile` files are handed out in collection order, so a long file
    collected last would leave one worker running alone at the end; started first, the short files
    fill in beside it. The order within a file is kept (the sort is stable).
    """
    rank: dict = {}
    for item in items:
        if item.get_closest_marker("slow"):
            rank[item.path] = 0
        elif _REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            rank[item.path] = min(rank.get(item.path, 1), 1)
    items.sort(key=lambda item: rank.get(item.path, 2))
