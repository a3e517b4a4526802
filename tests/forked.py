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
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

from rollshard.train.launcher import StageLauncher


@functools.cache
def _launcher() -> StageLauncher:
    """One warm server per test process, started at its first run."""
    return StageLauncher()


class Started:
    """A command started as a fork: as much of :class:`subprocess.Popen` as the tests use (``pid``, ``poll``,
    ``wait``, ``send_signal``, ``kill``, ``returncode``, and ``communicate``, which gives its stdout and stderr as
    text once it ended)."""

    def __init__(self, argv: tuple, env: dict[str, str] | None):
        self.args = [sys.executable, "-m", *map(str, argv)]
        self._folder = Path(tempfile.mkdtemp(prefix="rs-forked-"))
        weakref.finalize(self, shutil.rmtree, self._folder, True)  # its output files, once nothing holds it
        self._out, self._err = self._folder / "stdout", self._folder / "stderr"
        self._stage = _launcher().start(self.args, stdout=self._out, stderr=self._err, env=env)
        self.pid = self._stage.pid
        self.returncode: int | None = None
        self._ended: tuple[str, str] | None = None

    def poll(self) -> int | None:
        self.returncode = self._stage.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self._stage.wait(timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self._stage.send_signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to its process group: it and what it started (a no-op once it ended)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its stdout and stderr once it ended; past ``timeout`` seconds :class:`subprocess.TimeoutExpired`."""
        self.wait(timeout)
        if self._ended is None:
            self._ended = self.output()
        return self._ended

    def output(self) -> tuple[str, str]:
        """What it wrote to stdout and stderr so far."""
        return self._out.read_text(), self._err.read_text()


def start(*argv: str | os.PathLike, env: dict[str, str] | None = None) -> Started:
    """``python -m ARGV`` (``ARGV[0]`` the module) started, as :class:`subprocess.Popen` would; ``env`` replaces
    the environment."""
    return Started(argv, env)


def run(*argv: str | os.PathLike, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m ARGV`` (``ARGV[0]`` the module) as :func:`subprocess.run` with ``capture_output=True, text=True``
    gives it: the exit status (-N for signal N), stdout and stderr; ``env`` replaces the environment. Past
    ``timeout`` seconds the run is killed and :class:`subprocess.TimeoutExpired` raised."""
    proc = start(*argv, env=env)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise subprocess.TimeoutExpired(proc.args, timeout, *proc.communicate()) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
