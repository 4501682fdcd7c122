"""One error type for everything a user can get wrong.

Every `SpecrtError` names the problem and the fix, so the CLI can print two lines and exit instead
of a traceback. Library code raises it for bad input (files, configs, parameters); genuine bugs
still raise ordinary exceptions so they keep their tracebacks.
"""

from __future__ import annotations

import sys
from typing import Callable


class SpecrtError(Exception):
    """A user-facing error: `problem` says what is wrong, `fix` says what to do about it."""

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}\n  fix: {fix}" if fix else problem)


def run_reporting_errors(command: str, fn: Callable[[], int]) -> int:
    """Run a CLI command: a SpecrtError prints its problem and fix and returns 2 (no traceback)."""
    try:
        return fn()
    except SpecrtError as err:
        print(f"{command}: error: {err.problem}", file=sys.stderr)
        if err.fix:
            print(f"  fix: {err.fix}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
