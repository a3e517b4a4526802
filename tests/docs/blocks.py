"""The command blocks of the README and the reference pages under docs/, in reading order.

A command block is a fenced block whose language is ``bash``. The docs tier (``pytest -m docs``) runs every one in
order, as written, as a newcomer's shell would. A block that cannot run on a CPU machine without a network (a GPU,
an account, a browser) says so on the line before its fence: ``<!-- not run: REASON -->``; the index test holds
those few to a reason each. Other fenced blocks (``python``, output, trees) are not commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Reading order: the README, then the reference pages in the order it links them (later pages use what earlier
# blocks made, as a reader's shell would have it).
PAGES = (
    "README.md",
    "docs/generate.md",
    "docs/store.md",
    "docs/train.md",
    "docs/loop.md",
    "docs/results.md",
    "docs/performance.md",
    "docs/testing.md",
)

NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>[^>]*?)\s*-->")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    not_run: str | None  # the reason, for a command block marked not run

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_command(self) -> bool:
        return self.lang == "bash"


def blocks(page: str) -> list[Block]:
    """The fenced blocks of one page, in order."""
    lines = (ROOT / page).read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent = i, len(m["indent"])
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = "\n".join(line[indent:] for line in lines[start + 1 : j])
        prev = lines[start - 1] if start else ""
        marked = NOT_RUN.search(prev)
        out.append(Block(page, start + 1, m["lang"], body + "\n", marked["why"] if marked else None))
        i = j + 1
    return out


def command_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.is_command]
