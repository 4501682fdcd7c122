"""The copy files of an engine folder, built from data sets of the target's own answers.

`lookup.json` (calibrated copy hit rates: `specrt.runtime.proposers.lookup_prior`) and `datastore.npz`
(a store of the target's earlier text to copy from: `specrt.runtime.proposers.datastore`) are written
by `specrt export` for a target whose data set specrt ships (package data under specrt/tools/data),
and by `specrt calibrate` from any built data set. Building them replays the runtime's own copy
proposer over the data, so this lives above the runtime; the runtime only reads the files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from specrt.plugins.errors import SpecrtError
from specrt.runtime.proposers.datastore import store_key
from specrt.runtime.proposers.lookup import STORE_MAX_TOKENS, HitRecord, NgramIndex
from specrt.runtime.proposers.lookup_prior import DEFAULT_PRIOR_WEIGHT, LOOKUP_FILE, LookupPrior
from specrt.tools.build_data import DATA_ROOT, read_shards
from specrt.tools.train_features import is_validation


def replay_hits(sequences: Iterable[tuple[Sequence[int], Sequence[int]]], max_tokens: int = 16,
                min_match: int = 1, max_match: int = 8, weight: float = DEFAULT_PRIOR_WEIGHT,
                meta: dict | None = None, datastore=None) -> LookupPrior:
    """Count lookup hits over (prompt, response) pairs (module docstring). With a `datastore` the
    store's copies at each step are counted too (cells `datastore.store_key(m)`); the store must not
    hold these responses, or its hits are its own text."""
    record = HitRecord()
    steps = responses = tokens = 0
    for prompt, response in sequences:
        response = [int(t) for t in response]
        if not response:
            continue
        responses += 1
        tokens += len(response)
        index = NgramIndex(max_match)
        index.extend([int(t) for t in prompt] + response[:1])  # the first response token is the anchor
        t = 0  # index in `response` of the anchor
        while t + 1 < len(response):
            copy, match = index.continuation(max_tokens, min_match)
            truth = response[t + 1:t + 1 + len(copy)]
            right = 0
            while right < len(truth) and copy[right] == truth[right]:
                right += 1
            if match:
                # what the target emits after the anchor: the confirmed copies, then its own token
                record.record(min(match, max_match), copy, response[t + 1:t + 2 + right])
            if datastore is not None:
                stored, stored_match = datastore.chain(index.tokens, min(max_tokens, STORE_MAX_TOKENS))
                if stored_match:
                    record.record(store_key(stored_match), stored, response[t + 1:t + 1 + len(stored)])
            steps += 1
            advance = min(right + 1, len(response) - 1 - t)
            index.extend(response[t + 1:t + 1 + advance])
            t += advance
    info = {"responses": responses, "response_tokens": tokens, "steps": steps, "max_tokens": max_tokens,
            "min_match": min_match, "max_match": max_match}
    info.update(meta or {})
    return LookupPrior(record.trials, record.hits, weight, info)


def shipped_data_for(target_name: str) -> list[Path]:
    """The data sets in specrt's tools/data whose responses this target generated greedily."""
    found = []
    for manifest in sorted(DATA_ROOT.glob("*/manifest.json")):
        try:
            data = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        if data.get("target") == target_name and data.get("sampling", "greedy") == "greedy":
            found.append(manifest.parent)
    return found


def read_data_sets(folders: Sequence[str | Path]) -> tuple[list[dict], str]:
    """(every sample of the built data sets, a label naming them); refused when they hold none."""
    samples = [s for folder in folders for s in read_shards(Path(folder))]
    if not samples:
        raise SpecrtError(f"{', '.join(map(str, folders))} hold no data shards",
                          "pass a folder built by `specrt train data`")
    return samples, "data sets " + ", ".join(Path(f).name for f in folders)


def prior_from_data(folders: Sequence[str | Path], with_store: bool = False, **settings) -> LookupPrior:
    """Replay over built data sets (`specrt.tools.build_data`: shards of prompt / response ids);
    with_store: also the copy datastore's cells (`datastore.py`)."""
    return prior_from_samples(*read_data_sets(folders), with_store=with_store, **settings)


def prior_from_samples(samples: Sequence[dict], source: str, with_store: bool = False, **settings) -> LookupPrior:
    prior = replay_hits(((s["prompt"], s["response"]) for s in samples), meta={"source": source}, **settings)
    if with_store:
        # the store's cells: its copies replayed over held-out samples, from a store without them
        from specrt.runtime.proposers.datastore import datastore_from_samples

        store = datastore_from_samples(samples, source, exclude=is_validation)
        held_out = [(s["prompt"], s["response"]) for s in samples if is_validation(s["id"])]
        counted = replay_hits(held_out, datastore=store, **settings)
        for key in [k for k in counted.trials if k < 0]:
            prior.trials[key], prior.hits[key] = counted.trials[key], counted.hits[key]
        prior.meta["store_replay"] = {"held_out_responses": len(held_out), "store_entries": len(store)}
    return prior


def write_lookup_files(data: Sequence[Path], out: Path, settings: dict | None = None, progress=None) -> None:
    """lookup.json (own-text and store cells) and datastore.npz from built data sets of this target's
    greedy responses (`specrt calibrate`; `specrt export` for a target with shipped data)."""
    import sys

    from specrt.runtime.proposers.datastore import DATASTORE_FILE, datastore_from_samples

    say = progress or (lambda m: print(m, file=sys.stderr))
    say(f"lookup: replaying copies over {', '.join(map(str, data))}")
    samples, source = read_data_sets(data)  # read once: the replay and both stores use them
    prior = prior_from_samples(samples, source, with_store=True, **(settings or {}))
    prior.save(out / LOOKUP_FILE)
    report_prior(prior, out / LOOKUP_FILE, say)
    store = datastore_from_samples(samples, source)
    store.save(out / DATASTORE_FILE)
    say(f"wrote {out / DATASTORE_FILE}: {len(store)} n-grams of {store.meta['sequences']} responses; first store-copy "
        f"hit rate by match length {[round(prior.rate(k, 1), 2) for k in sorted(prior.trials, reverse=True) if k < 0]}")


def report_prior(prior: LookupPrior, path: Path, say=None) -> None:
    import sys

    say = say or (lambda m: print(m, file=sys.stderr))
    first = [round(prior.rate(n, 1), 2) for n in sorted(prior.trials) if n > 0]
    say(f"wrote {path}: {prior.meta['steps']} replayed steps; first-copy hit rate by match length {first}")
