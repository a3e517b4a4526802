"""Run a command module with gates: at the N-th call of a function, signal the test and wait.

    python -m tests.gated_main GATE_JSON MODULE ARGS...

Kill and interrupt tests use gates instead of racing a timer: the process stops at a
known point (its second checkpoint is on disk, its first shard committed, its final
commit about to start), writes the gate's ``signal`` file and waits there, until the
test kills it or creates the gate's ``release`` file, whatever the speed of the machine.

A gate's ``target`` is ``module:function`` or ``module:Class.method``; patch the name
where the caller looks it up (``rollshard.train.trainer:save_checkpoint``, not the
checkpoint module). ``before`` gates wait before the call, the others after it returns.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import runpy
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GATE_TIMEOUT_S = 600.0  # a deadline for a broken run, not an expectation of speed
POLL_S = 0.01


@dataclasses.dataclass
class Gate:
    target: str
    count: int
    signal: str
    release: str | None = None  # None: wait until killed
    before: bool = False


def _wait(gate: Gate) -> None:
    Path(gate.signal).write_text(gate.target)
    while gate.release is None or not Path(gate.release).exists():
        time.sleep(POLL_S)  # a plain sleep: signals sent by the test are handled here as anywhere else


def install_gate(gate: Gate) -> None:
    module_name, _, attr_path = gate.target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = attr_path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = {"n": 0}

    @functools.wraps(original)
    def gated(*args, **kwargs):
        calls["n"] += 1
        if gate.before and calls["n"] == gate.count:
            _wait(gate)
        out = original(*args, **kwargs)
        if not gate.before and calls["n"] == gate.count:
            _wait(gate)
        return out

    setattr(owner, name, gated)


def start_gated(gates: list[Gate], module: str, *args, **popen) -> subprocess.Popen:
    """``python -m module args`` in a subprocess with ``gates`` installed."""
    spec = json.dumps([dataclasses.asdict(g) for g in gates])
    cmd = [sys.executable, "-m", "tests.gated_main", spec, module, *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, **popen)


def fork_gated(gates: list[Gate], module: str, *args, env: dict[str, str] | None = None):
    """:func:`start_gated` as a fork of the test worker's warm server (tests/forked.py): the same process but for
    the imports it need not repeat."""
    from tests import forked

    return forked.start("tests.gated_main", json.dumps([dataclasses.asdict(g) for g in gates]), module, *args, env=env)


def wait_for_gate(proc: subprocess.Popen, gate: Gate) -> None:
    """Block until the gated process reached ``gate``; fail if it exits first."""
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not Path(gate.signal).exists():
        if proc.poll() is not None:
            raise AssertionError(f"the gated process exited ({proc.returncode}) before reaching {gate.target}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the gated process did not reach {gate.target} in {GATE_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)


def main() -> None:
    spec, module, *argv = sys.argv[1:]
    for gate in json.loads(spec):
        install_gate(Gate(**gate))
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
