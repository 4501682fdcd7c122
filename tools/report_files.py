"""One place that writes a benchmark's results: NAME.json (the data), NAME.md (the table), NAME.png."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path


def write_report(out: Path, name: str, report: dict, markdown: str, plot: Callable[[dict, Path], None]) -> list[Path]:
    """Write out/NAME.{json,md,png} (creating out), print the table, and return the three paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md", out / f"{name}.png"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown)
    plot(report, paths[2])
    print(markdown)
    print(f"wrote {out}/{name}.{{json,md,png}}", file=sys.stderr)
    return paths
