"""Calibrated hit rates for copied drafts: the lookup's prior, measured on the target's own text.

Why. The lookup (`specrt.runtime.proposers.lookup`) verifies a copied token while its estimated
survival stays above a threshold, and the serving scheduler (DSpark's Algorithm 1) spends verify
rows on copies by that same estimate. The estimate comes from the proposer's own record, which
starts empty: with a Beta(1, 1) prior every first copy looks 50% likely, so a fresh record (a new
generate call, the first steps of a server) verifies copies after one-token matches that are right
only ~1 time in 5. On a batch of rows that pads every row to the longest copy that is a slower
step than plain decoding (measured: 0.81x of plain at concurrency 4).

What. `specrt.tools.copy_files.replay_hits` replays lookup speculation over token sequences the target produced itself
(prompt, greedy response): at each step the longest earlier match of the history's suffix, the copy
that followed it, how many copied tokens the response confirms; the next step starts after the
confirmed copies and the target's own token, as live speculation would with the whole copy
verified. The counts are kept exactly as the live `HitRecord` keeps them (per match length and
draft depth: trials and hits, a trial at depth d only when the d-1 copies before it were right).

`LookupPrior` holds those counts; a record seeded with it estimates
    rate(n, d) = (hits + w * p) / (trials + w),  p = (prior hits + 1) / (prior trials + 2)
with `weight` w pseudo-trials per cell: the calibration decides the first steps, the live record
takes over as it grows. Stored as `lookup.json` in an engine folder (written by `specrt
calibrate`, read by `Pipeline.from_engines`), with its checksum in the folder's manifest.

Losslessness is untouched: the prior changes which copies are verified, never how they are checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specrt.plugins.errors import SpecrtError

LOOKUP_FILE = "lookup.json"
DEFAULT_PRIOR_WEIGHT = 16.0  # pseudo-trials per (match length, depth) cell
FORMAT = "specrt-lookup-prior/1"


@dataclass
class LookupPrior:
    """Replayed lookup hit counts: trials[n][d-1], hits[n][d-1] for match length n, depth d."""

    trials: dict[int, list[int]] = field(default_factory=dict)
    hits: dict[int, list[int]] = field(default_factory=dict)
    weight: float = DEFAULT_PRIOR_WEIGHT
    meta: dict = field(default_factory=dict)

    def rate(self, match: int, depth: int) -> float:
        """P(copy at depth d right | the d-1 before right), Beta(1, 1) over the replayed counts."""
        trials = self.trials.get(match, ())
        if depth > len(trials):
            return 0.5
        return (self.hits[match][depth - 1] + 1) / (trials[depth - 1] + 2)

    def to_json(self) -> dict:
        return {"format": FORMAT, "weight": self.weight, "meta": self.meta,
                "trials": {str(n): v for n, v in sorted(self.trials.items())},
                "hits": {str(n): v for n, v in sorted(self.hits.items())}}

    def save(self, path: str | Path) -> Path:
        from specrt.export.manifest import record_files

        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        if path.name == LOOKUP_FILE:  # in an engine folder, the runtime checks it against the manifest
            record_files(path.parent, [path.name])
        return path

    @classmethod
    def load(cls, path: str | Path) -> "LookupPrior":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
            trials = {int(n): [int(x) for x in v] for n, v in data["trials"].items()}
            hits = {int(n): [int(x) for x in v] for n, v in data["hits"].items()}
            if any(len(hits.get(n, ())) != len(v) for n, v in trials.items()):
                raise ValueError("trials and hits differ in length")
            if any(h > t for n in trials for h, t in zip(hits[n], trials[n])):
                raise ValueError("more hits than trials")
            return cls(trials, hits, float(data.get("weight", DEFAULT_PRIOR_WEIGHT)), dict(data.get("meta", {})))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise SpecrtError(f"cannot read the lookup calibration {path}: {e}",
                              f"re-run `specrt calibrate` for this engine folder, or delete {path.name}") from None


def load_prior_for(folder: str | Path | None) -> LookupPrior | None:
    """The engine folder's lookup.json, or None when it has none."""
    if folder is None or not (Path(folder) / LOOKUP_FILE).is_file():
        return None
    return LookupPrior.load(Path(folder) / LOOKUP_FILE)
