"""The loop's stages as forks of one warm process.

A stage (``python -m rollshard.generate ...``, ``python -m rollshard.train ...``) of a small round spends most
of its time importing torch and transformers: 4.5 of the 5.4 s a toy round's generation took on 2 cores. The
loop starts a fork server (:mod:`multiprocessing.forkserver`) that imports them once, while the loop checks its
flags; each stage is then a fork of that server running the same ``-m`` module with the same arguments: the same
exit status, output and files as the command it stands for, in a process group of its own, killed when the loop
dies (the server exits with the loop, and the stage with the server). A command of another form, or a loop run
with ``--fresh-stages``, starts a process of its own as before.

The server is started with SIGINT and SIGTERM blocked (and not ignored): a Ctrl-C at the terminal reaches the
loop, which forwards it to the running stage, and neither kills the server under a stage (nor stops its imports
halfway). Each stage unblocks them once its handlers are in place, so a signal the loop forwarded the moment the
stage started is delivered then, not lost.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import runpy
import shlex
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Protocol

import setproctitle

from rollshard.store.common import EXIT_FAILED, EXIT_INTERRUPTED
from rollshard.train.loop_stages import PR_SET_PDEATHSIG, die_with_parent, say

# What a stage imports that takes time; importing them in the server is what a stage saves. Not polars: it warns
# that a fork of a process that imported it may deadlock (its threads), so each stage imports it itself.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "torch.utils.tensorboard",
    "torch.distributed.checkpoint",
    "pyarrow.parquet",
    "pyarrow.dataset",
    "pyarrow.compute",
)
SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The process this module was imported in: in a stage, the fork server (its parent while the loop lives).
IMPORTED_IN = os.getpid()


class Stage(Protocol):
    """A started stage: as much of :class:`subprocess.Popen` as the loops use."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


class ForkedStage:
    """A stage forked from the server: its exit status as :class:`subprocess.Popen` gives it (-N: signal N)."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        self.pid: int = process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self._process.name), timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:  # reaped by the server once it ended: its pid may be another's
            os.kill(self.pid, sig)


class StageLauncher:
    """Starts the stage commands: ``[sys.executable, "-m", MODULE, *ARGS]`` forked from the warm server, any
    other command (or every one, ``fresh``) as a process of its own."""

    def __init__(self, *, fresh: bool = False, model: str | Path | None = None):
        self._context = None
        if fresh:
            return
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([__name__, *PRELOAD, *_architecture(model)])
        multiprocessing.resource_tracker.ensure_running()  # it unblocks signals itself: started first, outside
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        # Not ignored either (a loop run with nohup, or as a script's background job, ignores SIGINT): a fork
        # restores the server's first SIGINT handler before the stage sets its own, and restoring SIG_IGN would
        # drop a SIGINT the loop forwarded meanwhile.
        handlers = {sig: signal.signal(sig, signal.SIG_DFL) for sig in SIGNALS}
        try:
            multiprocessing.forkserver.ensure_running()
        except OSError as e:
            say(f"no warm stage server ({e}); each stage starts a process of its own")
            self._context = None
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def start(self, command: list[str], *, stdout: Path | None = None, stderr: Path | None = None,
              append: bool = False, env: dict[str, str] | None = None) -> Stage:
        """Start ``command``; its stdout and stderr go to the files named (opened for ``append`` or anew), else
        to the loop's stderr; ``env`` replaces the environment (default: the loop's)."""
        module = _module_of(command)
        for path in {stdout, stderr} - {None}:  # there once start() returned, whichever process writes them
            open(path, "a" if append else "w").close()
        if self._context is not None and module is not None:
            process = self._context.Process(
                target=_run_module, name=module,
                args=(module, command[3:], stdout and str(stdout), stderr and str(stderr), append,
                      dict(os.environ if env is None else env)),
                daemon=True,  # not waited for at the loop's exit: stopped (SIGTERM) and its end awaited
            )  # fmt: skip
            try:
                process.start()
                return ForkedStage(process)
            except (OSError, EOFError) as e:  # the server died (killed, or an import crashed it)
                say(f"the warm stage server is gone ({e}); each stage starts a process of its own from now on")
                self._context = None
        return _popen(command, stdout=stdout, stderr=stderr, append=append, env=env)


def _module_of(command: list[str]) -> str | None:
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m":
        return command[2]
    return None


def _architecture(model: str | Path | None) -> list[str]:
    """The modeling module of the model's architecture (its config.json's ``model_type``), when it has one."""
    try:
        kind = json.loads((Path(model) / "config.json").read_text())["model_type"]
    except (TypeError, OSError, ValueError, KeyError):
        return []
    return [f"transformers.models.{kind}.modeling_{kind}"] if str(kind).isidentifier() else []


def _popen(command: list[str], *, stdout: Path | None, stderr: Path | None, append: bool,
           env: dict[str, str] | None) -> subprocess.Popen:
    mode = "a" if append else "w"
    files = [open(p, mode) if p is not None else None for p in (stdout, stderr)]
    loop_pid = os.getpid()
    try:
        return subprocess.Popen(
            command, stdout=files[0] or sys.stderr, stderr=files[1], env=env,
            preexec_fn=lambda: die_with_parent(loop_pid), process_group=0,
        )  # fmt: skip
    finally:
        for f in files:
            if f is not None:
                f.close()


def _run_module(module: str, args: list[str], stdout: str | None, stderr: str | None, append: bool,
                env: dict[str, str]) -> None:
    """In the forked stage: what ``python -m MODULE ARGS`` would be, given the server's imports."""
    multiprocessing.current_process().daemon = False  # a stage may start processes of its own
    os.setpgid(0, 0)  # its own process group: a terminal's Ctrl-C reaches it once, from the loop
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != IMPORTED_IN:  # the server (so the loop) died before prctl
        os._exit(EXIT_INTERRUPTED)
    # The server hands each fork a copy of the pipe whose end tells it that its last client (the loop) is gone;
    # a stage holding it would keep the server, so itself, alive after a kill -9 of the loop.
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    # ps shows the stage, not the server (before the environment changes: the title takes the server's argv and
    # environment's memory)
    setproctitle.setproctitle(shlex.join([sys.executable, "-m", module, *args]))
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    for path, fd in ((stdout, 1), (stderr, 2)):
        if path is not None:
            target = os.open(path, flags, 0o666)
            os.dup2(target, fd)
            os.close(target)
        elif fd == 1:
            os.dup2(2, 1)  # a stage's lines go to the loop's stderr: the loop's stdout is its summary
    sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as an interpreter started on these files would
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # the server's torch read its own environment's
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [module, *args]
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # a signal forwarded meanwhile arrives now
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code: int | str | None = 0
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except BaseException:
        traceback.print_exc()
        code = EXIT_FAILED
    finally:
        atexit._run_exitfuncs()  # an interpreter's exit runs them; a forked process ends with os._exit
    sys.exit(code)
