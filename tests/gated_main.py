"""Run a command module with a gate: after the N-th return of one function, signal and block forever.

    python -m tests.gated_main rollshard.train.trainer:save_checkpoint 2 SIGNAL_FILE rollshard.train ARGS...

Kill tests use it instead of racing a timer: the process stops at a known point (its
second checkpoint is on disk, its first shard is committed), writes ``SIGNAL_FILE`` and
waits there until the test kills it, whatever the speed of the machine.
``TARGET`` is ``module:function`` or ``module:Class.method``; patch the name where the
caller looks it up (``rollshard.train.trainer:save_checkpoint``, not the checkpoint module).
"""

from __future__ import annotations

import functools
import importlib
import runpy
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GATE_TIMEOUT_S = 600.0  # a deadline for a broken run, not an expectation of speed


def install_gate(target: str, count: int, signal_file: Path) -> None:
    module_name, _, attr_path = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = attr_path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = {"n": 0}

    @functools.wraps(original)
    def gated(*args, **kwargs):
        out = original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == count:
            signal_file.write_text(str(calls["n"]))
            threading.Event().wait()  # until the test kills this process
        return out

    setattr(owner, name, gated)


def start_gated(target: str, count: int, signal_file: Path, module: str, *args, **popen) -> subprocess.Popen:
    """``python -m module args`` in a subprocess, gated at the ``count``-th return of ``target``."""
    cmd = [sys.executable, "-m", "tests.gated_main", target, str(count), str(signal_file), module, *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, **popen)


def wait_for_gate(proc: subprocess.Popen, signal_file: Path) -> None:
    """Block until the gated process reached its gate; fail if it exits first."""
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not signal_file.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the gated process exited ({proc.returncode}) before reaching its gate")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the gated process did not reach its gate in {GATE_TIMEOUT_S:.0f} s")
        time.sleep(0.01)


def main() -> None:
    target, count, signal_file, module, *argv = sys.argv[1:]
    install_gate(target, int(count), Path(signal_file))
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
