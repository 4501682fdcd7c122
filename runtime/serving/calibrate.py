"""SPS(B): target steps per second against the token positions a verify step computes.

The scheduler (`policy`, DSpark's Algorithm 1) trades expected accepted tokens against step time,
so it needs the step time of THIS device and backend. `profile_sps` measures it once:

- the engine holds `slots` rows, each prefilled with `context` random tokens (real K/V, so the
  attention reads a realistic window);
- for each B of a grid it times a target forward of B token positions laid out as the batcher
  lays them out: B <= slots is B rows x 1 token (plain decoding of B requests), B > slots is
  slots rows x B/slots tokens (every row verifying the same length, the padded layout);
- the median of `repeats` timed runs after `warmup` runs gives SPS(B) = 1 / median seconds.
Nothing is committed: the new tokens are scratch, so the context stays the same for every point.

The table is stored as `sps.json` next to an engine folder's manifest.json (`specrt calibrate` records
its checksum in the manifest, like every file the runtime reads), in `specrt.runtime.scheduler.SpsTable`'s format, with the
device, backend, threads, slots and context in `meta`, and plotted to `sps.png`.
"""

from __future__ import annotations

import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from specrt.plugins.errors import SpecrtError
from specrt.runtime.engine import causal_mask
from specrt.runtime.generate import prefill
from specrt.runtime.scheduler import SpsTable
from specrt.runtime.serving.rows import row_view

SPS_FILE = "sps.json"


def token_grid(slots: int, max_tokens: int) -> list[int]:
    """Powers of two up to `slots` (and `slots`), then slots x T for T in 2, 3, 4, 6, 8, 12, 16, 24, ...
    up to the first multiple of `slots` that reaches max_tokens."""
    grid = {b for b in (1 << i for i in range(16)) if b <= slots} | {slots}
    top = -(-max_tokens // slots)  # ceil
    steps = sorted({1 << k for k in range(1, 16)} | {3 << k for k in range(15)})
    grid |= {slots * t for t in steps if 2 <= t < top}
    if top >= 2:
        grid.add(slots * top)
    return sorted(grid)


def shape_for(b: int, slots: int) -> tuple[int, int]:
    if b <= slots:
        return b, 1
    if b % slots:
        raise ValueError(f"B={b} is not a multiple of the {slots} slots")
    return slots, b // slots


def profile_sps(engine, max_tokens: int, context: int = 128, repeats: int = 5, warmup: int = 2,
                seed: int = 0, meta: dict | None = None, progress=None) -> SpsTable:
    """Time verify steps of the engine's rows (module docstring). `engine` must allow row views."""
    slots = int(engine.batch_size)
    longest_step = max(shape_for(b, slots)[1] for b in token_grid(slots, max_tokens))
    if context < 1 or context + longest_step > engine.capacity + getattr(engine, "spare_slots", 0):
        raise SpecrtError(f"context {context} + {longest_step} step tokens do not fit the {engine.capacity}-slot cache",
                          "lower --context or raise --capacity")
    g = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    engine.reset(slots)
    prefill(engine, torch.randint(0, vocab, (slots, context), generator=g).tolist())
    tokens, sps = [], []
    for b in token_grid(slots, max_tokens):
        rows, t = shape_for(b, slots)
        view = row_view(engine, 0, rows)
        if view is None:
            raise SpecrtError("this engine does not expose row views", "profile a torch or ORT engine")
        ids = torch.randint(0, vocab, (rows, t), generator=g)
        positions = (view.lengths[:, None] + torch.arange(t)[None, :]).clone()
        mask = causal_mask(rows, t)
        times = []
        for i in range(warmup + repeats):
            start = time.perf_counter()
            view.forward(ids, positions, mask)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        tokens.append(b)
        sps.append(1.0 / statistics.median(times))
        if progress is not None:
            progress(b, rows, t, sps[-1])
    info = {"slots": slots, "context": context, "repeats": repeats, "warmup": warmup,
            "threads": torch.get_num_threads(), "machine": platform.machine(), "processor": platform.processor(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "layout": "B <= slots: B rows x 1 token; B > slots: slots rows x B/slots tokens"}
    info.update(meta or {})
    return SpsTable(tokens, sps, meta=info)


def plot_sps(table: SpsTable, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    b = table.tokens
    s = table.steps_per_second
    ax1.plot(b, s, "o-")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("token positions per step (B)")
    ax1.set_ylabel("target steps / s  (SPS)")
    ax1.grid(True, alpha=0.3)
    ax2.plot(b, [x * y for x, y in zip(b, s)], "o-", color="tab:orange")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("token positions per step (B)")
    ax2.set_ylabel("B x SPS(B)  (positions / s)")
    ax2.grid(True, alpha=0.3)
    meta = table.meta
    fig.suptitle(title or f"SPS profile: {meta.get('engine', '')} {meta.get('backend', '')} {meta.get('device', '')} "
                 f"slots {meta.get('slots')} context {meta.get('context')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_sps_for(folder: str | Path | None, explicit: str | Path | None = None) -> SpsTable | None:
    """The SPS table given explicitly, or the engine folder's sps.json when there is one."""
    if explicit:
        return SpsTable.load(explicit)
    if folder is not None and (Path(folder) / SPS_FILE).is_file():
        return SpsTable.load(Path(folder) / SPS_FILE)
    return None
