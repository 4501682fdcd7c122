"""Drafting options: one set of defaults, then the engine folder's record, then each flag the user gave."""

from __future__ import annotations

import json
import sys

import pytest

from specrt.export.draft_options import DraftOptions, folder_draft_options, from_manifest, resolve
from specrt.tools import cli_generate
from specrt.tools.cli import build_parser, main

FOLDER_RECORD = {
    "tree": {"top_k": 3, "depth": 3, "total_tokens": 6},
    "policy": {"threshold": 0.25, "max_drafts": None, "block_tree_top_k": 1},
    "lookup": {"max_tokens": 12, "threshold": 0.3, "min_match": 2, "max_match": 6, "alone_above": 0.9},
}


@pytest.fixture()
def folder(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"drafting": FOLDER_RECORD}))
    return tmp_path


def _options_seen_by_generate(monkeypatch, argv: list[str]) -> DraftOptions:
    """Run `specrt generate ARGV` as a user would (sys.argv set) and capture the options it loads with."""
    seen = {}

    class Stop(Exception):
        pass

    def fake_build(args, options):
        seen["options"] = options
        raise Stop

    monkeypatch.setattr(sys, "argv", ["specrt", *argv])
    monkeypatch.setattr(cli_generate, "build_pipeline", fake_build)
    with pytest.raises(Stop):
        main(argv)
    return seen["options"]


def test_one_flag_on_a_folder_keeps_every_other_recorded_default(folder, monkeypatch):
    options = _options_seen_by_generate(
        monkeypatch, ["generate", "--engines", str(folder), "--prompt", "hi", "--lookup", "8"])
    assert options.lookup == 8  # the flag given
    assert (options.tree_top_k, options.tree_depth, options.tree_tokens) == (3, 3, 6)  # the folder's tree
    assert options.confidence_threshold == 0.25
    assert (options.lookup_threshold, options.lookup_min_match, options.lookup_max_match) == (0.3, 2, 6)


def test_no_flag_gives_the_folder_record_and_each_flag_overrides_only_itself(folder, monkeypatch):
    plain = _options_seen_by_generate(monkeypatch, ["generate", "--engines", str(folder), "--prompt", "hi"])
    assert plain == from_manifest({"drafting": FOLDER_RECORD})
    tree = _options_seen_by_generate(
        monkeypatch, ["generate", "--engines", str(folder), "--prompt", "hi", "--tree-depth", "4"])
    assert tree == resolve(plain, {"tree_depth": 4})


def test_serve_resolves_like_generate(folder):
    args = build_parser().parse_args(["serve", "--engines", str(folder), "--tree-tokens", "5"])
    from specrt.tools.draft_flags import resolve_draft_options

    assert resolve_draft_options(args, folder) == resolve(from_manifest({"drafting": FOLDER_RECORD}),
                                                         {"tree_tokens": 5})


def test_defaults_are_defined_once():
    """The CLI flags default to None, so the only defaults are DraftOptions' (and a folder's record)."""
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    from specrt.tools.draft_flags import draft_flags, resolve_draft_options

    assert draft_flags(args) == {}
    assert resolve_draft_options(args) == DraftOptions()
    export_args = build_parser().parse_args(["export", "--drafter", "none"])
    assert resolve_draft_options(export_args) == DraftOptions()


def test_folders_written_before_the_drafting_section_read_their_drafter_section(tmp_path):
    old = {"drafter": {"kind": "eagle3", "tree": {"top_k": 2, "depth": 3, "total_tokens": 5}}}
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    options = folder_draft_options(tmp_path)
    assert (options.tree_top_k, options.tree_depth, options.tree_tokens) == (2, 3, 5)
    assert options.lookup == DraftOptions().lookup  # not recorded: the default
