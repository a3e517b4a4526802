"""Preloaded into a test's stage server: each fork waits, before the server restores its signal handlers, until
a SIGINT or SIGTERM is pending for it. The launcher's tests use it to send a stage its signal inside that window
whatever the speed of the machine (a race the loop meets when it forwards a Ctrl-C the moment a stage starts)."""

from __future__ import annotations

import multiprocessing.forkserver
import signal
import time
from pathlib import Path

_serve_one = multiprocessing.forkserver._serve_one


def _pending() -> bool:
    status = Path("/proc/self/status").read_text()
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(m >> (sig - 1) & 1 for m in masks for sig in (signal.SIGINT, signal.SIGTERM))


def gated(*args):
    while not _pending():
        time.sleep(0.001)
    return _serve_one(*args)


multiprocessing.forkserver._serve_one = gated
