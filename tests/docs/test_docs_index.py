"""The README and docs/ hang together (default tier, no command run): every page is in the reading order the
docs tier runs, every command block runs or says why not, and every link between the pages resolves."""

from __future__ import annotations

import re

from tests.docs.blocks import PAGES, ROOT, blocks, command_blocks


def test_every_page_is_read_in_order() -> None:
    pages = {"README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))}
    assert pages == set(PAGES)


def test_command_blocks_run_or_say_why_not() -> None:
    commands = command_blocks()
    not_run = [b for b in commands if b.not_run is not None]
    assert len(commands) >= 20
    for b in not_run:
        assert len(b.not_run) >= 10, f"{b.id}: say why the block cannot run here"
    # A handful that need what this machine lacks (a GPU, an account, a browser, a server of yours), no more.
    assert len(not_run) <= 8, [b.id for b in not_run]
    # A marker must sit on a command block, not drift onto prose or another kind of block.
    for page in PAGES:
        lines = (ROOT / page).read_text().splitlines()
        marked = {i + 2 for i, line in enumerate(lines) if line.lstrip().startswith("<!-- not run:")}
        assert marked == {b.line for b in blocks(page) if b.not_run is not None and b.is_command}, page


def test_commands_are_written_one_way() -> None:
    """Bare ``rollshard-*`` commands in the activated venv, never ``.venv/bin/rollshard-*`` beside them."""
    for b in command_blocks():
        assert ".venv/bin/rollshard-" not in b.text, b.id


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_resolve() -> None:
    anchors = {}
    for page in PAGES:
        text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
        anchors[page] = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for page in PAGES:
        here = (ROOT / page).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", (ROOT / page).read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, frag = target.partition("#")
            dest = (here / path).resolve() if path else (ROOT / page).resolve()
            assert dest.exists(), f"{page}: link to {target}: no {path}"
            if frag and dest.suffix == ".md":
                rel = str(dest.relative_to(ROOT))
                assert frag in anchors[rel], f"{page}: link to {target}: no such heading in {rel}"


def test_ci_runs_the_docs_tier() -> None:
    """CI (.ci/run) runs scripts/test.sh, whose pytest runs select every marked tier: default, docs, slow, sglang."""
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    runs = [line for line in (ROOT / "scripts" / "test.sh").read_text().splitlines() if " -m pytest " in line]
    selected = [re.search(r' -m "([^"]+)"| -m (\w+)', line.split(" -m pytest ", 1)[1]) for line in runs]
    tiers = {t for m in selected if m for t in re.split(r"\s+or\s+", m.group(1) or m.group(2))}
    assert tiers == {"docs", "slow", "sglang"} and any(m is None for m in selected), runs  # + one unmarked (default)
