"""Where a command's output goes: tables or one JSON document on stdout, one-line errors and warnings and the
progress display (:func:`rollshard.store.common.progress`, tqdm) on stderr."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from rollshard.store.commands.parser import PROG
from rollshard.store.common import print_error, progress


@dataclass(frozen=True, kw_only=True)
class Context:
    """What every command is run with besides its arguments."""

    out: Console  # stdout: the tables, or the JSON document
    err: Console  # stderr
    argv: list[str]  # the command line after the program's name (filter records it in the lineage)

    @classmethod
    def open(cls, argv: list[str] | None) -> "Context":
        return cls(out=Console(highlight=False, soft_wrap=False), err=Console(stderr=True, highlight=False),
                   argv=sys.argv[1:] if argv is None else list(argv))


def error(message: str) -> None:
    """One unwrapped line on stderr (rich would wrap it at the terminal width)."""
    print_error(PROG, message)


def warning(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def print_json(out: Console, doc: Any) -> None:
    out.file.write(json.dumps(doc, indent=1, default=str) + "\n")
    out.file.flush()


def busy(what: str, *, hidden: bool = False):
    """A one-line display of the step under way (shown on a terminal only, cleared when done)."""
    return progress(desc=what, bar_format="{desc} ({elapsed})", leave=False, disable=True if hidden else None)
