"""Target hidden states for drafter training, computed once and cached on disk.

    store = ensure_features(dataset_folder, target, tap_layers, cache_dir=None)
    store.taps(i, [2, 15, 27])      -> fp16 [len_i, 3*H]   hidden_states[2], [15], [27] of sample i
    store.hidden(i, L)              -> fp16 [len_i, H]     hidden_states[L]: the last layer's raw output
    store.batch(indices, layers)    -> FeatureBatch of padded float32 torch tensors
    store.train_indices, store.val_indices                 deterministic 95 / 5 split by id hash
    ConcatFeatureStore([store_a, store_b])                 several data sets as one (trainers' --data A B)

Why a cache: all three drafters read the same target features (the taps of the prompt + response
and the last hidden state, whose `lm_head(norm(h_L))` gives the target's logits), and every trainer
runs several epochs. One target forward per sample, shared by every epoch of every drafter, is
cheaper on this CPU than recomputing the target on the fly (which would cost the 30-layer target's
forward in every training step, more than the drafter step itself).

What is stored (folder `~/.cache/specrt/features/<dataset-hash>` unless `cache_dir` is given; never
committed): `h<NN>.f16` one fp16 memmap [total_tokens, H] per hidden_states index (the union of
the requested taps and L), `tokens.i32` the token ids, `index.npz` (offsets, lengths, prompt
lengths, sample ids) and `meta.json` (dataset hash, target fingerprint, taps, progress). The
dataset hash covers the shards' bytes; the target fingerprint (config + every weight) is checked
on reuse, so a different target or a missing tap rebuilds the cache (with the union of the taps
asked for then and before). Values beyond fp16's range are clamped and counted in meta.json.

Computation: samples are sorted by length and grouped into batches of at most `batch_tokens`
padded tokens; each batch is one forward of the target through its own call contract (fresh
explicit cache, causal mask with padded keys masked, `logit_rows` of one row so the 49k-wide LM
head is skipped). After each batch the memmaps are flushed and the progress is written, so an
interrupted run resumes at the first unfinished batch (the batch plan is a pure function of the
lengths and `batch_tokens`).

Cost: one 30-layer forward per token; 314 tokens/s measured for SmolLM2-135M on 1 torch thread
while another job kept both cores busy, so a ~1M-token data set takes about an hour once, and
~7 GB of disk (7 hidden states x 576 x fp16 per token for the default taps of all three drafters).

Validation split: a sample is held out when the first 8 hex digits of sha256(id) / 2**32 < 0.05,
so the split is stable across dataset rebuilds and machines.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from specrt.plugins.errors import SpecrtError

FORMAT_VERSION = 1
VALIDATION_FRACTION = 0.05
FP16_MAX = 65504.0
DEFAULT_CACHE_ROOT = Path(os.environ.get("SPECRT_CACHE", Path.home() / ".cache" / "specrt")) / "features"


def is_validation(sample_id: str, fraction: float = VALIDATION_FRACTION) -> bool:
    """Deterministic held-out membership: sha256(id) mapped to [0, 1) below `fraction`."""
    digest = hashlib.sha256(str(sample_id).encode()).hexdigest()
    return int(digest[:8], 16) / 2**32 < fraction


def dataset_hash(folder: Path) -> str:
    """sha256 of the shard files (names and bytes) of a built data set."""
    h = hashlib.sha256()
    shards = sorted(Path(folder).glob("shard_*.json.gz"))
    if not shards:
        raise SpecrtError(f"no shard_*.json.gz in {folder}", "build the data set first: python -m specrt.tools.build_data")
    for shard in shards:
        h.update(shard.name.encode())
        h.update(shard.read_bytes())
    return h.hexdigest()


def target_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the target's config and weights (so a cache never serves another target)."""
    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        h.update(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        t = tensor.detach().contiguous().cpu()
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


def plan_batches(lengths: Sequence[int], batch_tokens: int, max_batch: int = 64) -> list[list[int]]:
    """Sample indices grouped longest first so that batch * longest <= batch_tokens (a pure function)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = int(lengths[current[0]]) if current else int(lengths[i])
        if current and ((len(current) + 1) * longest > batch_tokens or len(current) >= max_batch):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@dataclass
class FeatureBatch:
    """Padded tensors of a few samples (padding: token 0, features 0; use `lengths`)."""

    indices: list[int]
    tokens: torch.Tensor  # [B, N] int64
    lengths: torch.Tensor  # [B] int64
    prompt_lengths: torch.Tensor  # [B] int64
    taps: torch.Tensor | None  # [B, N, n_taps*H] float32
    last: torch.Tensor | None  # [B, N, H] float32, hidden_states[L]

    @property
    def valid(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]


class _Batching:
    """`batch` for any store with per-sample `tokens`, `taps`, `hidden` and the index arrays."""

    def batch(self, indices: Sequence[int], layers: Sequence[int] | None, with_last: bool = True) -> FeatureBatch:
        indices = [int(i) for i in indices]
        n = int(max(self.lengths[i] for i in indices))
        b = len(indices)
        tokens = torch.zeros(b, n, dtype=torch.long)
        taps = torch.zeros(b, n, len(layers) * self.hidden_size) if layers else None
        last = torch.zeros(b, n, self.hidden_size) if with_last else None
        for row, i in enumerate(indices):
            m = int(self.lengths[i])
            tokens[row, :m] = torch.from_numpy(self.tokens(i))
            if taps is not None:
                taps[row, :m] = torch.from_numpy(self.taps(i, layers).astype(np.float32))
            if last is not None:
                last[row, :m] = torch.from_numpy(self.hidden(i, self.last_layer).astype(np.float32))
        return FeatureBatch(
            indices, tokens, torch.tensor([int(self.lengths[i]) for i in indices]),
            torch.tensor([int(self.prompt_lengths[i]) for i in indices]), taps, last,
        )


class FeatureStore(_Batching):
    """Random access to the cached features of one data set (read-only memmaps)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "meta.json").read_text())
        index = np.load(self.folder / "index.npz", allow_pickle=False)
        self.offsets = index["offsets"].astype(np.int64)
        self.lengths = index["lengths"].astype(np.int64)
        self.prompt_lengths = index["prompt_lengths"].astype(np.int64)
        self.ids = [str(x) for x in index["ids"]]
        self.hidden_size = int(self.meta["hidden_size"])
        self.num_layers = int(self.meta["num_layers"])
        self.tap_layers = [int(i) for i in self.meta["tap_layers"]]
        total = int(self.meta["total_tokens"])
        self._tokens = np.memmap(self.folder / "tokens.i32", dtype=np.int32, mode="r", shape=(total,))
        self._maps = {
            layer: np.memmap(self.folder / _layer_file(layer), dtype=np.float16, mode="r", shape=(total, self.hidden_size))
            for layer in self.tap_layers
        }
        val = np.array([is_validation(i) for i in self.ids], dtype=bool)
        self.val_indices = np.flatnonzero(val)
        self.train_indices = np.flatnonzero(~val)

    # -- per sample ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete"))

    @property
    def last_layer(self) -> int:
        return self.num_layers

    def tokens(self, i: int) -> np.ndarray:
        o, n = self.offsets[i], self.lengths[i]
        return np.asarray(self._tokens[o:o + n], dtype=np.int64)

    def response(self, i: int) -> np.ndarray:
        return self.tokens(i)[self.prompt_lengths[i]:]

    def _check_layers(self, layers: Sequence[int]) -> None:
        missing = [int(l) for l in layers if int(l) not in self._maps]
        if missing:
            raise SpecrtError(
                f"the feature cache {self.folder} holds hidden_states {self.tap_layers}, not {missing}",
                "call ensure_features with every tap layer the drafter needs",
            )

    def hidden(self, i: int, layer: int) -> np.ndarray:
        self._check_layers([layer])
        o, n = self.offsets[i], self.lengths[i]
        return np.asarray(self._maps[int(layer)][o:o + n])

    def taps(self, i: int, layers: Sequence[int]) -> np.ndarray:
        """hidden_states[layers] of sample i concatenated along features: fp16 [len, len(layers)*H]."""
        self._check_layers(layers)
        return np.concatenate([self.hidden(i, l) for l in layers], axis=-1)

class ConcatFeatureStore(_Batching):
    """Several data sets' stores seen as one: global sample i is store k's sample i - start_k.

    The training split is the union of the parts' splits. The held-out indices are interleaved
    (first held-out sample of each part, then the second, ...) so that "the first N held-out
    samples" (what the trainers validate on) covers every data set, not only the first one.
    """

    def __init__(self, stores: Sequence[FeatureStore]) -> None:
        if not stores:
            raise SpecrtError("no feature stores to concatenate", "pass at least one --data folder")
        first = stores[0]
        for other in stores[1:]:
            if (other.hidden_size, other.num_layers) != (first.hidden_size, first.num_layers):
                raise SpecrtError(f"the feature caches {first.folder} and {other.folder} come from different targets",
                                  "build every --data set's features with the same target")
        self.parts = list(stores)
        self.folder = first.folder
        self.hidden_size, self.num_layers = first.hidden_size, first.num_layers
        self.tap_layers = sorted(set.intersection(*(set(p.tap_layers) for p in self.parts)))
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])[:-1].astype(np.int64)
        self.lengths = np.concatenate([p.lengths for p in self.parts])
        self.prompt_lengths = np.concatenate([p.prompt_lengths for p in self.parts])
        self.ids = [i for p in self.parts for i in p.ids]
        self.train_indices = np.concatenate([p.train_indices + s for p, s in zip(self.parts, self.starts)])
        held = [list(p.val_indices + s) for p, s in zip(self.parts, self.starts)]
        longest = max(len(h) for h in held)
        self.val_indices = np.array([h[j] for j in range(longest) for h in held if j < len(h)], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def complete(self) -> bool:
        return all(p.complete for p in self.parts)

    @property
    def last_layer(self) -> int:
        return self.num_layers

    def _locate(self, i: int) -> tuple[FeatureStore, int]:
        k = int(np.searchsorted(self.starts, int(i), side="right")) - 1
        return self.parts[k], int(i) - int(self.starts[k])

    def tokens(self, i: int) -> np.ndarray:
        part, j = self._locate(i)
        return part.tokens(j)

    def response(self, i: int) -> np.ndarray:
        part, j = self._locate(i)
        return part.response(j)

    def hidden(self, i: int, layer: int) -> np.ndarray:
        part, j = self._locate(i)
        return part.hidden(j, layer)

    def taps(self, i: int, layers: Sequence[int]) -> np.ndarray:
        part, j = self._locate(i)
        return part.taps(j, layers)


def _layer_file(layer: int) -> str:
    return f"h{int(layer):02d}.f16"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


@torch.inference_mode()
def _forward_taps(model, seqs: list[np.ndarray]) -> torch.Tensor:
    """One target forward over right-padded sequences -> taps [B, T, n_taps*H] (model's dtype)."""
    b = len(seqs)
    t = max(len(s) for s in seqs)
    device = model.embed_tokens.weight.device
    ids = torch.zeros(b, t, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.from_numpy(np.asarray(s, dtype=np.int64))
    lengths = torch.tensor([len(s) for s in seqs])
    positions = torch.arange(t).expand(b, t)
    valid = torch.arange(t)[None, :] < lengths[:, None]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))[None] & valid[:, None, :]
    k_cache, v_cache = model.new_cache(b, t, model.embed_tokens.weight.dtype)
    logit_rows = torch.zeros(b, 1, dtype=torch.long, device=device)
    _, taps = model(ids.to(device), positions.to(device), mask.to(device), k_cache, v_cache,
                    positions.to(device), logit_rows)
    return taps.float().cpu()


def ensure_features(
    dataset_folder: str | Path,
    target,
    tap_layers: Sequence[int],
    cache_dir: str | Path | None = None,
    batch_tokens: int = 8192,
    max_batches: int | None = None,
    progress: bool = True,
) -> FeatureStore:
    """Compute (or reuse, or resume) the feature cache of a built data set and return its store.

    `target` is a LlamaModel (or a LoadedTarget). hidden_states[L] (the last layer) is always stored
    besides `tap_layers`. `max_batches` computes at most that many batches in this call (the store
    is then incomplete: `store.complete` is False; call again to resume).
    """
    from specrt.tools.build_data import read_shards
    from tqdm import tqdm

    model = getattr(target, "model", target)
    cfg = model.config
    dataset_folder = Path(dataset_folder)
    data_hash = dataset_hash(dataset_folder)
    folder = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_ROOT / data_hash[:16]
    wanted = sorted({int(i) for i in tap_layers} | {cfg.num_layers})
    bad = [i for i in wanted if not 0 <= i <= cfg.num_layers]
    if bad:
        raise SpecrtError(f"tap layers {bad} are outside hidden_states[0..{cfg.num_layers}]",
                          "pick tap indices between 0 (embeddings) and the number of layers")
    fingerprint = target_fingerprint(model)

    meta = None
    if (folder / "meta.json").exists():
        meta = json.loads((folder / "meta.json").read_text())
        reusable = (
            meta.get("version") == FORMAT_VERSION and meta.get("dataset_hash") == data_hash
            and meta.get("target_fingerprint") == fingerprint and set(wanted) <= set(meta.get("tap_layers", []))
        )
        if reusable and meta.get("complete"):
            return FeatureStore(folder)
        if reusable and meta.get("batch_tokens") != batch_tokens:
            batch_tokens = int(meta["batch_tokens"])  # resume with the plan the cache was started with
        if not reusable:
            if meta.get("dataset_hash") == data_hash and meta.get("target_fingerprint") == fingerprint:
                wanted = sorted(set(wanted) | {int(i) for i in meta.get("tap_layers", [])})
            print(f"feature cache {folder} does not match (data, target, taps or batching changed): rebuilding",
                  file=sys.stderr)
            meta = None

    samples = read_shards(dataset_folder)
    if not samples:
        raise SpecrtError(f"the data set {dataset_folder} has no samples", "build it first")
    lengths = np.array([len(s["prompt"]) + len(s["response"]) for s in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    total = int(lengths.sum())
    hidden = cfg.hidden_size
    batches = plan_batches(lengths.tolist(), batch_tokens)

    if meta is None:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("h*.f16"):
            stale.unlink()
        tokens = np.memmap(folder / "tokens.i32", dtype=np.int32, mode="w+", shape=(total,))
        for s, o in zip(samples, offsets):
            seq = list(s["prompt"]) + list(s["response"])
            tokens[o:o + len(seq)] = seq
        tokens.flush()
        del tokens
        np.savez(folder / "index.npz", offsets=offsets, lengths=lengths,
                 prompt_lengths=np.array([len(s["prompt"]) for s in samples], dtype=np.int64),
                 ids=np.array([str(s["id"]) for s in samples]))
        for layer in wanted:
            np.memmap(folder / _layer_file(layer), dtype=np.float16, mode="w+", shape=(total, hidden)).flush()
        meta = {
            "version": FORMAT_VERSION, "dataset": str(dataset_folder), "dataset_hash": data_hash,
            "target_fingerprint": fingerprint, "tap_layers": wanted, "hidden_size": hidden,
            "num_layers": cfg.num_layers, "num_samples": len(samples), "total_tokens": total,
            "batch_tokens": batch_tokens, "num_batches": len(batches), "batches_done": 0,
            "dtype": "float16", "clamped_values": 0, "complete": False, "seconds": 0.0,
        }
        _write_json(folder / "meta.json", meta)

    layers = [int(i) for i in meta["tap_layers"]]
    maps = {l: np.memmap(folder / _layer_file(l), dtype=np.float16, mode="r+", shape=(total, hidden)) for l in layers}
    done = int(meta["batches_done"])
    old_taps = tuple(model.tap_layers)
    model.set_taps(layers)
    start = time.perf_counter()
    made = 0
    bar = tqdm(total=len(batches), initial=done, desc="target features", unit="batch", file=sys.stderr,
               disable=not progress)
    try:
        for bi in range(done, len(batches)):
            if max_batches is not None and bi - done >= max_batches:
                break
            batch = batches[bi]
            seqs = [np.asarray(list(samples[i]["prompt"]) + list(samples[i]["response"])) for i in batch]
            taps = _forward_taps(model, seqs)
            over = int((taps.abs() > FP16_MAX).sum())
            if over:
                taps = taps.clamp(-FP16_MAX, FP16_MAX)
            half = taps.to(torch.float16).numpy()
            for row, i in enumerate(batch):
                o, n = int(offsets[i]), int(lengths[i])
                for t, layer in enumerate(layers):
                    maps[layer][o:o + n] = half[row, :n, t * hidden:(t + 1) * hidden]
            for mm in maps.values():
                mm.flush()
            made += int(sum(lengths[i] for i in batch))
            meta["batches_done"] = bi + 1
            meta["clamped_values"] = int(meta["clamped_values"]) + over
            meta["seconds"] = float(meta["seconds"]) + (time.perf_counter() - start)
            start = time.perf_counter()
            meta["complete"] = meta["batches_done"] == len(batches)
            _write_json(folder / "meta.json", meta)
            bar.update(1)
            elapsed = max(float(bar.format_dict.get("elapsed") or 0.0), 1e-6)
            bar.set_postfix(tok_s=f"{made / elapsed:.0f}")
    finally:
        bar.close()
        model.set_taps(old_taps)
        del maps
    if meta.get("clamped_values"):
        print(f"warning: {meta['clamped_values']} hidden-state values exceeded fp16 range and were clamped",
              file=sys.stderr)
    return FeatureStore(folder)


__all__ = [
    "DEFAULT_CACHE_ROOT",
    "ConcatFeatureStore",
    "FeatureBatch",
    "FeatureStore",
    "dataset_hash",
    "ensure_features",
    "is_validation",
    "plan_batches",
    "target_fingerprint",
]
