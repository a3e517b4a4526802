"""``scripts/make_sglang_env.sh``'s check of an existing environment: one ``import sglang`` the first time, then the
stamp it leaves, so a test run does not import sglang only to learn it is there. A build is never started here:
``PYTHON=false`` makes one fail at its first step, which is what a wrong answer of the check would reach."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "make_sglang_env.sh"


def check(venv: Path, *, version: str = "0.5.23", stub: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSHARD_", "PYTHONPATH"))}
    env.update(ROLLSHARD_SGLANG_VENV=str(venv), ROLLSHARD_SGLANG_VERSION=version, PYTHON="false")
    if stub is not None:
        env["PYTHONPATH"] = str(stub)
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_the_first_check_imports_sglang_and_later_ones_read_its_stamp(tmp_path):
    venv, stub = tmp_path / "venv", tmp_path / "stub"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (stub / "sglang").mkdir(parents=True)
    (stub / "sglang" / "__init__.py").write_text('__version__ = "0.5.23"\n')

    first = check(venv, stub=stub)  # sglang imports (the stub on the path): ready, and the stamp is written
    assert first.returncode == 0 and first.stdout == f"sglang environment ready: {venv} (0.5.23)\n", first.stderr
    assert (venv / ".rollshard-sglang-ready").read_text() == "0.5.23\n"

    second = check(venv)  # no stub: an import would fail, the stamp answers
    assert second.returncode == 0 and second.stdout == first.stdout, second.stderr

    other = check(venv, version="0.6.0")  # another pin: neither the stamp nor the import says ready, so it builds
    assert other.returncode != 0 and "ready" not in other.stdout  # (a build that fails: PYTHON=false, or no disk)


def test_a_venv_where_the_stamp_cannot_be_written_is_still_ready(tmp_path):
    venv, stub = tmp_path / "venv", tmp_path / "stub"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".rollshard-sglang-ready").mkdir()  # unwritable as a file (as a venv of another user's would be)
    (stub / "sglang").mkdir(parents=True)
    (stub / "sglang" / "__init__.py").write_text('__version__ = "0.5.23"\n')
    p = check(venv, stub=stub)
    assert p.returncode == 0 and p.stdout == f"sglang environment ready: {venv} (0.5.23)\n", p.stderr
