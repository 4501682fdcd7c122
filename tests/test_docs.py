"""The user documentation stays true to the code: the CLI page is the parsers' own text, its examples
parse, every relative link in docs/ resolves, and no page reads as a work journal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from specrt.tools import gen_cli_docs
from specrt.tools.cli import build_parser

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_cli_page_is_generated_from_todays_parsers():
    assert (DOCS / "cli.md").read_text() == gen_cli_docs.render(), (
        "docs/cli.md is out of date: run `python -m specrt.tools.gen_cli_docs`")


@pytest.mark.parametrize("example", [e for examples in gen_cli_docs.EXAMPLES.values() for e in examples])
def test_cli_examples_parse(example):
    argv = shlex.split(example)[1:]
    args = build_parser().parse_args(argv)
    if args.command == "train":  # the options go to the tool's own parser
        gen_cli_docs._train_parsers()[args.kind].parse_args(args.options)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_in_docs_resolves():
    broken = []
    for page in sorted(DOCS.rglob("*.md")):
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            linked = page.parent / target if target else page
            if not linked.exists():
                broken.append(f"{page.relative_to(DOCS)} -> {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(DOCS)} -> {target}#{anchor}")
    assert not broken, broken


def test_docs_do_not_read_as_a_work_journal():
    pattern = re.compile(r"session [0-9]|issue [0-9]|#[0-9]+ ", re.IGNORECASE)
    hits = [f"{p.relative_to(DOCS)}: {line.strip()}" for p in sorted(DOCS.rglob("*.md"))
            for line in p.read_text().splitlines() if pattern.search(line)]
    assert not hits, hits
