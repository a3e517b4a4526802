"""``python -m rollshard.X ARGS`` for a test, as a fork of a warm server: what a loop's stage is (train/launcher.py).

A command of the tests' that checks what a run writes, prints and exits with spent most of its time importing
torch and transformers (2.5 of a CPU second per process, a hundred processes in the default tier). Forked from
one server per test worker that imported them once, it is the process the loop runs as a stage: the same module,
arguments, environment, files and exit status (tests/train/test_launcher.py holds that to the bit). Tests of an
interpreter's own start (``--help``, a missing extra, what a module imports) start a process of their own, and the
docs tier runs every command as a reader's shell does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from rollshard.train.launcher import StageLauncher


@functools.cache
def _launcher() -> StageLauncher:
    """One warm server per test process, started at its first run."""
    return StageLauncher()


def run(*argv: str | os.PathLike, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m ARGV`` (``ARGV[0]`` the module) as :func:`subprocess.run` with ``capture_output=True, text=True``
    gives it: the exit status (-N for signal N), stdout and stderr; ``env`` replaces the environment. Past
    ``timeout`` seconds the run is killed and :class:`subprocess.TimeoutExpired` raised."""
    command = [sys.executable, "-m", *map(str, argv)]
    with tempfile.TemporaryDirectory(prefix="rs-forked-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        stage = _launcher().start(command, stdout=out, stderr=err, env=env)
        try:
            code = stage.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # the stage's own group: it and what it started
                os.killpg(stage.pid, signal.SIGKILL)
            stage.wait()
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text()) from None
        return subprocess.CompletedProcess(command, code, out.read_text(), err.read_text())
