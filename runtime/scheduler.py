"""DSpark's hardware-aware prefix scheduler (paper Algorithm 1) and the SPS table it reads.

Reference: DeepSeek, "DSpark: Confidence-Scheduled Speculative Decoding with Semi-Autoregressive
Generation", arXiv 2607.05147 (sec. 3.2 and Appendix A); code deepseek-ai/DeepSpec.

Inputs
------
- For every request r, survival probabilities a_{r,j} = prod_{i<=j} c_{r,i}, j = 1..gamma: the
  (calibrated) probability that draft j and all drafts before it are accepted. c_{r,j} is the
  confidence head's output for position j; it is computed from the backbone state and the PREVIOUS
  draft token (c_k = sigmoid(w . [h_k ; W1[x_{k-1}]])), so a_{r,j} is known before x_{r,j} is drawn.
  a is non-increasing in j.
- SPS(B): target steps per second when one verify step carries B tokens in total (all requests),
  profiled once on the device (`SpsTable`).

Algorithm 1
-----------
Every request always verifies its anchor: B starts at R (the number of requests) and the expected
number of emitted tokens tau at R (each request gets at least its bonus token), so the starting
throughput is the plain-decoding one, R * SPS(R). Pool all candidates (r, j) with a_{r,j} > 0, sort
them by a descending (ties: smaller j first, then smaller r), and admit them one at a time: B += 1,
tau += a_{r,j}, keep it while Theta = tau * SPS(B) strictly improves on the best so far, and STOP at
the first candidate that does not improve it. Each request verifies the candidates admitted for it,
which form a prefix 1..l_r (a is non-increasing in j and ties go to the smaller j).

Why the early stop matters (what makes the scheduler lossless)
-------------------------------------------------------------
Speculative sampling is lossless only if the decision to verify draft x_j does not depend on x_j
itself: the acceptance rule min(1, p/q) assumes x_j ~ q_j, and conditioning on an event that
involves x_j changes its law (a scheduler that verified x_j only when x_j is a "good" token would
skew the output towards the tokens it likes). With the early stop, whether (r, j) is admitted is
decided by the candidates sorted before it, i.e. by other requests (independent) and by
a_{r,1..j}, which depend only on x_{r,1..j-1}; the later candidates a_{r,j+1}, ... (which depend on
x_{r,j} through c_{r,j+1}) are never looked at before the decision. The verify length is a
stopping time of the draft process, and the standard proof goes through (Appendix A of the paper).
A "global" search that scans the whole sorted list and keeps the prefix with the best Theta looks
ahead: it may admit (r, j) only because a_{r,j+1} (hence x_{r,j}) is favourable. With a non-concave
SPS curve that happens, and the output distribution is no longer the target's
(tests/test_scheduler.py builds such a case and measures the bias exactly). In greedy decoding the
drafts are deterministic and either rule is lossless; in sampling only the early stop is.

The early stop also never admits a token that, at the moment it is considered, lowers the expected
throughput: the schedule's Theta rises monotonically from the plain-decoding value.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from specrt.plugins.errors import SpecrtError

__all__ = ["SpsTable", "Schedule", "schedule", "survival"]

SPS_FORMAT = "specrt.sps"
SPS_VERSION = 1


class SpsTable:
    """Measured target steps per second against verify tokens per step, with interpolation.

    Points (B, SPS(B)) with B strictly increasing positive integers and SPS finite and > 0. Between
    measured points the step TIME (1 / SPS) is interpolated linearly (step time is close to affine
    in B, SPS is not); at a measured B the measured value is returned exactly. Outside the measured
    range it raises SpecrtError: profile the sizes you will use (`max_tokens` is the largest).

    JSON (`save`/`load`): {"format": "specrt.sps", "version": 1, "tokens": [...],
    "steps_per_second": [...], "meta": {...}} (meta: free-form, e.g. device, engine, date).
    """

    def __init__(self, tokens: Sequence[int], steps_per_second: Sequence[float], meta: dict | None = None,
                 source: str = "SPS table") -> None:
        self.source = source
        if len(tokens) != len(steps_per_second):
            raise SpecrtError(
                f"{source}: {len(tokens)} token counts but {len(steps_per_second)} SPS values",
                "give one steps-per-second value per measured token count (re-run the SPS profile)",
            )
        if not tokens:
            raise SpecrtError(f"{source} has no points", "profile at least one verify size (re-run the SPS profile)")
        clean_b: list[int] = []
        clean_s: list[float] = []
        for b, s in zip(tokens, steps_per_second):
            if isinstance(b, bool) or not isinstance(b, (int, float)) or int(b) != b or b < 1:
                raise SpecrtError(f"{source}: token count {b!r} is not a positive integer",
                                  "token counts are verify tokens per step: 1, 2, 4, ... (re-run the SPS profile)")
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                raise SpecrtError(f"{source}: SPS {s!r} at B={int(b)} is not a finite positive number",
                                  "re-run the SPS profile on this device")
            if clean_b and int(b) <= clean_b[-1]:
                raise SpecrtError(
                    f"{source}: token counts must be strictly increasing (B={int(b)} after B={clean_b[-1]})",
                    "sort the points and drop duplicates, or re-run the SPS profile",
                )
            clean_b.append(int(b))
            clean_s.append(float(s))
        self.tokens = clean_b
        self.steps_per_second = clean_s
        self.meta = dict(meta or {})

    @property
    def min_tokens(self) -> int:
        return self.tokens[0]

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    def __call__(self, b: int) -> float:
        if not self.min_tokens <= b <= self.max_tokens:
            raise SpecrtError(
                f"{self.source} covers {self.min_tokens}..{self.max_tokens} verify tokens, asked for B={b}",
                f"re-run the SPS profile up to at least {b} tokens, or cap the scheduler with max_tokens",
            )
        i = bisect_left(self.tokens, b)
        if self.tokens[i] == b:
            return self.steps_per_second[i]
        b0, b1 = self.tokens[i - 1], self.tokens[i]
        t0, t1 = 1.0 / self.steps_per_second[i - 1], 1.0 / self.steps_per_second[i]
        return 1.0 / (t0 + (t1 - t0) * (b - b0) / (b1 - b0))

    def to_json(self) -> dict:
        return {"format": SPS_FORMAT, "version": SPS_VERSION, "tokens": list(self.tokens),
                "steps_per_second": list(self.steps_per_second), "meta": dict(self.meta)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: object, source: str = "SPS table") -> "SpsTable":
        if not isinstance(data, dict) or data.get("format") != SPS_FORMAT:
            raise SpecrtError(f"{source} is not an SPS table (expected \"format\": \"{SPS_FORMAT}\")",
                              "point to the sps.json written by the SPS profile, or re-run it")
        if data.get("version") != SPS_VERSION:
            raise SpecrtError(
                f"{source} has SPS table version {data.get('version')!r}; this specrt reads version {SPS_VERSION}",
                "re-run the SPS profile with this specrt, or upgrade specrt",
            )
        tokens, sps = data.get("tokens"), data.get("steps_per_second")
        if not isinstance(tokens, list) or not isinstance(sps, list):
            raise SpecrtError(f"{source}: \"tokens\" and \"steps_per_second\" must be lists",
                              "re-run the SPS profile")
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            raise SpecrtError(f"{source}: \"meta\" must be an object", "re-run the SPS profile")
        return cls(tokens, sps, meta=meta, source=source)

    @classmethod
    def load(cls, path: str | Path) -> "SpsTable":
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise SpecrtError(
                f"SPS table {path} does not exist",
                "profile the target on this device first (it writes sps.json next to the engines)",
            ) from None
        except OSError as exc:
            raise SpecrtError(f"cannot read SPS table {path}: {exc}", "check the path and its permissions") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecrtError(
                f"SPS table {path} is not valid JSON ({exc})", "re-run the SPS profile to rewrite it"
            ) from None
        return cls.from_json(data, source=f"SPS table {path}")

    def __repr__(self) -> str:
        pts = ", ".join(f"{b}:{s:g}" for b, s in zip(self.tokens, self.steps_per_second))
        return f"SpsTable({pts})"


@dataclass(frozen=True)
class Schedule:
    """The scheduler's decision for one verify step.

    lengths[r]: drafts request r verifies (its first lengths[r] drafts);
    tau: expected tokens emitted by the step over all requests (R bonus tokens + admitted survivals);
    tokens: B, verify tokens in the step (R anchors + sum(lengths));
    throughput: tau * SPS(B), expected tokens per second; baseline: R * SPS(R) (plain decoding).
    """

    lengths: list[int]
    tau: float
    tokens: int
    throughput: float
    baseline: float


def survival(confidences: Sequence[float]) -> list[float]:
    """a_j = prod_{i<=j} c_i from per-position conditional acceptance confidences c_i in [0, 1]."""
    out: list[float] = []
    acc = 1.0
    for c in confidences:
        c = float(c)
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"confidence {c} is not in [0, 1]")
        acc *= c
        out.append(acc)
    return out


def schedule(
    survivals: Sequence[Sequence[float]],
    sps: SpsTable | Callable[[int], float],
    max_tokens: int | None = None,
) -> Schedule:
    """Algorithm 1: per-request draft lengths maximising tau * SPS(B) with the early stop (module doc).

    survivals[r] = [a_{r,1}, ..., a_{r,gamma_r}] (non-increasing, in [0, 1]; may be empty);
    sps: an SpsTable or any callable B -> steps per second; max_tokens caps B (defaults to the
    table's largest measured size; candidates beyond it are not admitted).
    """
    rows: list[list[float]] = []
    for r, row in enumerate(survivals):
        vals = [float(a) for a in row]
        for j, a in enumerate(vals):
            if not (0.0 <= a <= 1.0):
                raise ValueError(f"survival a[{r}][{j + 1}] = {a} is not in [0, 1]")
            if j and a > vals[j - 1]:
                raise ValueError(f"survival of request {r} increases at draft {j + 1} ({vals[j - 1]} -> {a}): "
                                 "survivals are cumulative products of confidences")
        rows.append(vals)
    n_req = len(rows)
    lengths = [0] * n_req
    if n_req == 0:
        return Schedule(lengths=[], tau=0.0, tokens=0, throughput=0.0, baseline=0.0)
    if max_tokens is None and isinstance(sps, SpsTable):
        max_tokens = sps.max_tokens
    if max_tokens is not None and n_req > max_tokens:
        raise SpecrtError(f"{n_req} requests need at least {n_req} verify tokens but the cap is {max_tokens}",
                          "lower the concurrency, or profile SPS up to more verify tokens")

    tau = float(n_req)
    b = n_req
    best = tau * float(sps(b))
    baseline = best
    # candidates (a, j, r); sort: a descending, then j ascending, then r ascending
    candidates = [(a, j, r) for r, row in enumerate(rows) for j, a in enumerate(row, start=1) if a > 0.0]
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    for a, j, r in candidates:
        if max_tokens is not None and b + 1 > max_tokens:
            break
        theta = (tau + a) * float(sps(b + 1))
        if not theta > best:
            break  # the early stop: never look past the first non-improving candidate
        # a prefix per request: j is always the next draft of request r (sort order + monotone a)
        assert j == lengths[r] + 1, "survivals must be non-increasing"
        lengths[r] = j
        tau += a
        b += 1
        best = theta
    return Schedule(lengths=lengths, tau=tau, tokens=b, throughput=best, baseline=baseline)
