"""Copies from a store of the target's own earlier text: drafts where the request's own text has none.

Why. The lookup (`lookup.py`) copies from the request's own prompt and answer, which pays where the
text repeats itself and is silent elsewhere: on MT-bench's first turns (int4 target, greedy, 256
tokens) about half the steps find no useful earlier match. A small target is formulaic across
requests too ("Here are some ...", "In conclusion, ..."), so a store of what it generated for other
prompts predicts the next token often enough to be worth a verify row: replayed over MT-bench, the
store's first copy is right 17-67% of the time by match length (own text: 22-95%), and choosing per
step whichever of the two expects more accepted copies lifts accepted copies per step 1.39 -> 1.49
(a one-off replay over MT-bench). This is retrieval-based drafting (REST's idea) on a tiny store.

What. `NgramDatastore` maps every n-gram (n = 1..max_match) of the stored responses to the token
that most often followed it. A chain is a greedy walk: the longest suffix of the history found in
the store gives the next token; the walk appends it and goes on while a suffix of at least
`min_continue` tokens is found, up to max_tokens. The chain's match length (of its first token) keys
its hit rates in the lookup's record (negative keys, `store_key`), so the calibrated survival of a
store copy is learned apart from the request's own copies.

Storage. One sorted uint64 array of n-gram hashes (n mixed in) and the int32 next token of each, for
all n together: 1.4M entries and ~16 MB for the embedded default's 4k responses, built with numpy in
~7 s, saved as `datastore.npz` in an engine folder (`specrt export` writes it for a target
with shipped data, `specrt calibrate` for any). A lookup hashes the <= max_match suffixes and does one
`searchsorted`. A hash collision can only propose a wrong token, which verification rejects: the
store never affects what is emitted, only how fast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from specrt.plugins.errors import SpecrtError

DATASTORE_FILE = "datastore.npz"
DEFAULT_STORE_MATCH = 6
DEFAULT_MIN_CONTINUE = 2  # a chain goes on past its first token only on matches this long
_MUL = np.uint64(0x100000001B3)  # FNV-1a's 64-bit prime
_SEED = np.uint64(0xCBF29CE484222325)
FORMAT = "specrt-datastore/1"


def store_key(match: int) -> int:
    """The lookup record's key for a store copy whose first token came from a `match`-token suffix."""
    return -int(match)


_MASK = (1 << 64) - 1


def _hash_suffixes(history: Sequence[int], longest: int) -> np.ndarray:
    """Hashes of the last n tokens of `history` for n = 1..longest (the store's key of each), in
    Python ints (numpy scalar arithmetic costs ~1 us an operation); equal to `build`'s uint64 ones."""
    out = []
    h, mul = int(_SEED), int(_MUL)
    for n in range(1, longest + 1):
        h = ((h ^ (int(history[-n]) + 1)) * mul) & _MASK
        out.append(((h ^ n) * mul) & _MASK)
    return np.array(out, dtype=np.uint64)


class NgramDatastore:
    """n-gram hash -> most frequent next token, over token sequences the target generated."""

    def __init__(self, keys: np.ndarray, next_tokens: np.ndarray, max_match: int = DEFAULT_STORE_MATCH,
                 min_continue: int = DEFAULT_MIN_CONTINUE, meta: dict | None = None) -> None:
        if keys.shape != next_tokens.shape or keys.ndim != 1:
            raise ValueError("keys and next_tokens must be 1-D arrays of one length")
        self.keys = np.ascontiguousarray(keys, dtype=np.uint64)
        self.next_tokens = np.ascontiguousarray(next_tokens, dtype=np.int32)
        self.max_match, self.min_continue = int(max_match), int(min_continue)
        self.meta = dict(meta or {})

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], max_match: int = DEFAULT_STORE_MATCH,
              min_continue: int = DEFAULT_MIN_CONTINUE, meta: dict | None = None) -> "NgramDatastore":
        """Count, for every n-gram of every sequence, which token followed it; keep the most frequent
        (ties: the smaller token id, so a build is deterministic)."""
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences if len(s) > 1]
        if not seqs:
            raise SpecrtError("no token sequences to build a datastore from", "pass responses with >= 2 tokens")
        # one array with a -1 between sequences: no n-gram spans two of them
        corpus = np.concatenate([np.append(s, -1) for s in seqs])
        keys_all, next_all = [], []
        with np.errstate(over="ignore"):
            h = np.full(corpus.shape[0], _SEED, dtype=np.uint64)  # h[j]: hash of the n tokens ending at j
            valid = np.ones(corpus.shape[0], dtype=bool)
            tokens = (corpus + 1).astype(np.uint64)
            for n in range(1, max_match + 1):
                # extend each window one token to the left: tokens[j-n+1] joins the hash ending at j
                shifted = np.empty_like(tokens)
                shifted[n - 1:] = tokens[: tokens.shape[0] - n + 1]
                shifted[: n - 1] = 0
                h = (h ^ shifted) * _MUL
                valid[: n - 1] = False
                valid[n - 1:] &= corpus[: corpus.shape[0] - n + 1] >= 0
                key = (h ^ np.uint64(n)) * _MUL
                # the n-gram ends at j, its next token is corpus[j + 1]
                ok = valid[:-1] & (corpus[1:] >= 0)
                keys_all.append(key[:-1][ok])
                next_all.append(corpus[1:][ok])
        keys = np.concatenate(keys_all)
        nexts = np.concatenate(next_all)
        # most frequent next token per key: count (key, next) pairs, order by key, count desc, token asc
        pairs = np.stack([keys, nexts.astype(np.uint64)], axis=1)
        uniq, counts = np.unique(pairs, axis=0, return_counts=True)
        order = np.lexsort((uniq[:, 1], -counts, uniq[:, 0]))
        uniq = uniq[order]
        first = np.ones(uniq.shape[0], dtype=bool)
        first[1:] = uniq[1:, 0] != uniq[:-1, 0]
        info = {"sequences": len(seqs), "tokens": int(sum(s.shape[0] for s in seqs))}
        info.update(meta or {})
        return cls(uniq[first, 0], uniq[first, 1].astype(np.int32), max_match, min_continue, info)

    # ------------------------------------------------------------------ lookup
    def next_token(self, history: Sequence[int]) -> tuple[int, int]:
        """(most frequent next token after the longest stored suffix of history, its length); (-1, 0): none."""
        longest = min(self.max_match, len(history))
        if longest == 0 or len(self) == 0:
            return -1, 0
        hashes = _hash_suffixes(history, longest)
        at = np.searchsorted(self.keys, hashes).tolist()  # one numpy call; the rest on Python ints
        size = len(self)
        for n in range(longest - 1, -1, -1):  # the longest suffix found
            i = at[n]
            if i < size and int(self.keys[i]) == int(hashes[n]):
                return int(self.next_tokens[i]), n + 1
        return -1, 0

    def chain(self, history: Sequence[int], max_tokens: int,
              go_on: Callable[[int, int], bool] | None = None) -> tuple[list[int], int]:
        """(greedy walk of up to max_tokens stored continuations, match length of its first token).

        go_on(first match length, tokens so far): whether a next token is worth a lookup (each costs
        ~20 us of hashing and search); the first is always looked up."""
        tail = list(history[-self.max_match:])
        out: list[int] = []
        first = 0
        while len(out) < max_tokens:
            if out and go_on is not None and not go_on(first, len(out)):
                break
            token, match = self.next_token(tail)
            if match == 0 or (out and match < self.min_continue):
                break
            if not out:
                first = match
            out.append(token)
            tail = (tail + [token])[-self.max_match:]
        return out, first

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        import json

        from specrt.export.manifest import record_files

        path = Path(path)
        with open(path, "wb") as f:  # a file object: np.savez would append .npz to another suffix
            np.savez(f, keys=self.keys, next_tokens=self.next_tokens,
                     config=np.array(json.dumps({"format": FORMAT, "max_match": self.max_match,
                                                 "min_continue": self.min_continue, "meta": self.meta})))
        if path.name == DATASTORE_FILE:  # in an engine folder, the runtime checks it against the manifest
            record_files(path.parent, [path.name])
        return path

    @classmethod
    def load(cls, path: str | Path) -> "NgramDatastore":
        import json
        import zipfile
        import zlib

        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                config = json.loads(str(data["config"]))
                if config.get("format") != FORMAT:
                    raise ValueError(f"format {config.get('format')!r}, expected {FORMAT!r}")
                keys, nexts = data["keys"], data["next_tokens"]
            if keys.dtype != np.uint64 or keys.shape != nexts.shape or (keys.size > 1 and not (keys[1:] > keys[:-1]).all()):
                raise ValueError("keys must be sorted, unique uint64 with one next token each")
            return cls(keys, nexts, int(config["max_match"]), int(config["min_continue"]), config.get("meta", {}))
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            # empty, truncated or bit-flipped files raise any of these from numpy's zip reader
            raise SpecrtError(f"cannot read the copy datastore {path} ({type(e).__name__}: {e})",
                              f"re-run `specrt calibrate` for this engine folder, or delete {path.name}") from None


def load_datastore_for(folder: str | Path | None, vocab_size: int | None = None) -> NgramDatastore | None:
    """The engine folder's datastore.npz, or None when it has none; refused when it proposes token ids
    the target's vocabulary lacks (a store built for another target)."""
    if folder is None or not (Path(folder) / DATASTORE_FILE).is_file():
        return None
    path = Path(folder) / DATASTORE_FILE
    store = NgramDatastore.load(path)
    if vocab_size is not None and len(store) and int(store.next_tokens.max()) >= vocab_size:
        raise SpecrtError(f"{path} proposes token {int(store.next_tokens.max())}, but the target's vocabulary has "
                          f"{vocab_size} tokens: the store was built for another vocabulary",
                          f"re-run `specrt calibrate --engines {folder}`, or delete {path.name}")
    return store


def datastore_from_samples(samples: Sequence[dict], source: str, exclude=None, **settings) -> NgramDatastore:
    """A store over the responses of built data-set samples (`specrt train data` shards, read by
    `specrt.tools.copy_files.read_data_sets`); `exclude(sample_id)` leaves samples out (the calibration replays
    held-out ones against a store without them)."""
    responses = [s["response"] for s in samples if exclude is None or not exclude(s["id"])]
    return NgramDatastore.build(responses, meta={"source": source}, **settings)
