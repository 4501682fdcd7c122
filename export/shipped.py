"""Drafters shipped inside the package for the embedded default target.

Layout: `specrt/export/drafters/<target-name>/<kind>/{config.json,model.safetensors}` (fp16,
official formats, each under 30 MB), installed as package data so `pip install .` carries them.
`shipped_drafter(kind, target_name)` returns the folder or None.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED_ROOT = Path(__file__).resolve().parent / "drafters"


def shipped_drafter(kind: str, target_name: str) -> Path | None:
    folder = SHIPPED_ROOT / target_name / kind
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    return None


def shipped_kinds(target_name: str) -> list[str]:
    root = SHIPPED_ROOT / target_name
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if shipped_drafter(p.name, target_name))
