"""Torch's intra-op thread count while ONNX Runtime does the compute.

On the ORT backend torch does only host bookkeeping between session calls: argmax over the verify
rows, tree masks, the drafters' top-k. Given more than one thread, torch parallelises those small
ops and its OpenMP workers keep spinning after each one, on the same cores ONNX Runtime's pool needs
for the next call. Measured (int4 target, copies from the text, 6 MT-bench prompts x 256 tokens,
2 cores): 8.1 s with torch at 2 threads, 5.1 s at 1 (argmax 2.0 -> 0.14 ms per step and the
target call itself 9.7 -> 6.9 ms). Plain decoding hardly notices: one row's argmax stays serial.

So ORT pipelines and the ORT server run their loop with torch at one thread. The count is
process-wide in torch, hence a context manager that restores it: a benchmark that also runs the
torch backend in the same process keeps its threads for that.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

ORT_HOST_THREADS = 1


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with torch at n intra-op threads (None: leave it as it is)."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
