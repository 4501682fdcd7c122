"""Write docs/cli.md from the `specrt` argparse parsers, so the CLI reference cannot drift from the code.

    python -m specrt.tools.gen_cli_docs            # rewrite docs/cli.md
    python -m specrt.tools.gen_cli_docs --check    # exit 1 if docs/cli.md differs (tests/test_docs.py)

Every subcommand of `specrt.tools.cli.SUBCOMMANDS` gets its one-line description, its usage line and a
table per argument group; `specrt train KIND` forwards to a tool that builds its own parser inside its
`main`, so that parser is caught at its `parse_args` call (`_parser_of`). The hand-written examples
below are checked by the test: each must parse with today's parser.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
from pathlib import Path

from specrt.tools.cli import SUBCOMMANDS, build_parser
from specrt.tools.cli_train import TOOLS as TRAIN_TOOLS

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the checkout (tools/ lives in it)
DOC_PATH = PACKAGE_ROOT / "docs" / "cli.md"
WIDTH = 100  # usage lines wrap at this width whatever the terminal

EXAMPLES: dict[str, list[str]] = {
    "generate": [
        'specrt generate --engines engines/smollm2-int4 --drafter lookup --prompt "Why is the sky blue?" --speedup',
        'specrt generate --engines engines/smollm2-eagle3 --drafter none --prompt "Hi"',
        'specrt generate --prompt "Hi" --temperature 0.7 --top-p 0.9 --seed 1',
        'specrt generate --target path/to/model.gguf --prompt "Hi"',
        "specrt generate --backend torch --drafter dspark --drafter-ckpt runs/dspark/drafter --prompt Hi",
    ],
    "export": [
        "specrt export --drafter none --weights int4 --out engines/smollm2-int4",
        "specrt export --drafter eagle3 --out engines/smollm2-eagle3",
        "specrt export --drafter dflash --drafter-ckpt path/to/dflash --target path/to/hf_folder --out engines/my-dflash",
        "specrt export --drafter none --weights w8a8 --out engines/smollm2-w8a8",
    ],
    "build": [
        "specrt build --engines engines/smollm2-eagle3 --trt --fp16",
        "specrt build --engines engines/smollm2-eagle3 --trt --fp16 --no-plugins --capacity 2048",
    ],
    "train": [
        "specrt train data --num-prompts 3000",
        "specrt train eagle3 --out runs/eagle3 --threads 2",
        "specrt train dspark --out runs/dspark --threads 2",
        "specrt train sts --drafter runs/dspark/drafter",
    ],
    "bench": [
        "specrt bench --engines engines/smollm2-int4 --drafters lookup --compare ort-genai,llama.cpp --prompts 80",
        "specrt bench --drafters eagle3=runs/eagle3/drafter --prompts 8 --speed-prompts 0",
    ],
    "doctor": ["specrt doctor"],
    "inspect-drafter": ["specrt inspect-drafter export/drafters/SmolLM2-135M-Instruct/eagle3"],
    "serve": [
        "specrt serve --engines engines/smollm2-int4 --drafter lookup --slots 8 --port 8000",
        "specrt serve --engines engines/smollm2-eagle3 --schedule fixed",
    ],
    "calibrate": ["specrt calibrate --engines engines/smollm2-int4 --drafter lookup --slots 4"],
    "bench-serving": [
        "specrt bench-serving --engines engines/smollm2-w8a8 --lookup-alone --concurrency 1,2,4 --repeats 2",
    ],
}


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _parser_of(main, argv: list[str]) -> argparse.ArgumentParser:
    """The parser a tool's `main(argv)` builds, caught when it starts parsing (nothing else runs)."""
    original = argparse.ArgumentParser.parse_args

    def catch(self, *args, **kwargs):
        raise _Caught(self)

    argparse.ArgumentParser.parse_args = catch  # type: ignore[method-assign]
    try:
        main(argv)
    except _Caught as caught:
        return caught.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{main.__module__}.main never parsed its arguments")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _help_text(action: argparse.Action, prog: str) -> str:
    """The help as --help prints it: argparse %-formats it with the action's fields (%(default)s, and
    %% for a literal percent sign). Not argparse's private `HelpFormatter._expand_help`: a default
    path inside the package is written portably here (`_portable`), as in the default column."""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params.update(prog=prog, default=_portable(action.default))
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return (action.help or "") % params


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest}`"
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{names}`"
    metavar = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices
                                 else action.dest.upper())
    return f"`{names} {metavar}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or action.required:
        return "required" if action.required else ""
    values = action.default if isinstance(action.default, (list, tuple)) else [action.default]
    return "`" + " ".join(_portable(v) for v in values) + "`"


def _portable(value) -> str:
    """A default path inside the installed package, written relative to it (it differs per machine)."""
    if isinstance(value, (str, Path)) and Path(value).is_absolute():
        try:
            return Path(value).resolve().relative_to(PACKAGE_ROOT).as_posix()
        except ValueError:
            return str(value)
    return str(value)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _render_parser(parser: argparse.ArgumentParser, level: str) -> list[str]:
    lines = ["```", _usage(parser), "```", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if not actions:
            continue
        title = group.title if group.title not in ("options", "optional arguments") else "options"
        lines += [f"{level} {title}", "", "| argument | default | what it does |", "|---|---|---|"]
        for a in actions:
            lines.append(f"| {_flag(a)} | {_default(a)} | {_cell(_help_text(a, parser.prog))} |")
        lines.append("")
    return lines


def _train_parsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {}
    for kind, (module, fixed) in sorted(TRAIN_TOOLS.items()):
        parser = _parser_of(importlib.import_module(module).main, fixed)
        parser.prog = f"specrt train {kind}"
        parser.description = (parser.description or "").strip().split("\n\n")[0]
        parsers[kind] = parser
    return parsers


def render() -> str:
    """docs/cli.md as the parsers define it today."""
    subs = _subparsers(build_parser())
    lines = [
        "# Command-line reference",
        "",
        ("<!-- Generated by `python -m specrt.tools.gen_cli_docs` from the argparse parsers; do not edit by hand."
         " tests/test_docs.py fails when this page and the parsers disagree. -->"),
        "",
        "One console script, `specrt`, with one subcommand per job. Bad input (a missing file, a folder this",
        "version cannot read, a flag that does not fit the engines) exits with status 2 and a message that",
        "names the problem and the fix. `specrt SUBCOMMAND --help` prints the same options.",
        "",
        "| subcommand | what it does |",
        "|---|---|",
    ]
    lines += [f"| [`{name}`](#specrt-{name}) | {_cell(help_text)} |" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines.append("")
    for name, (_, help_text) in SUBCOMMANDS.items():
        lines += [f"## specrt {name}", "", _cell(help_text[0].upper() + help_text[1:]) + ".", ""]
        if EXAMPLES.get(name):
            lines += ["```bash", *EXAMPLES[name], "```", ""]
        if name == "train":
            lines += ["`specrt train KIND [options]` hands every option after KIND to that tool.", ""]
            for kind, parser in _train_parsers().items():
                lines += [f"### specrt train {kind}", "", _cell(parser.description), ""]
                lines += _render_parser(parser, "####")
        else:
            lines += _render_parser(subs[name], "###")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specrt.tools.gen_cli_docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 if the page is out of date")
    parser.add_argument("--out", type=Path, default=DOC_PATH, help="the page to write (default: docs/cli.md)")
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):  # some tools print while building their parser
        text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run python -m specrt.tools.gen_cli_docs", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
