"""A stand-in stage for the launcher's tests: what a started ``python -m`` module sees of its process.

    python -m tests.train.stage_probe OUT_JSON [--exit N] [--threads] [--wait READY_FILE]

Writes OUT_JSON (its arguments, working folder, ``PROBE`` variable, whether it leads its process group, its
SIGINT/SIGTERM handlers and blocked signals, its command line as ps shows it, with ``--threads`` torch's threads), prints a line to stdout and one to
stderr, then exits N; with ``--wait`` it writes READY_FILE and waits until a signal ends it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    out, *rest = sys.argv[1:]
    code = int(rest[rest.index("--exit") + 1]) if "--exit" in rest else 0
    seen = {
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "probe": os.environ.get("PROBE"),
        "leads_its_group": os.getpgid(0) == os.getpid(),
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "cmdline": Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip(),
    }
    if "--threads" in rest:  # torch's intra-op threads (OMP_NUM_THREADS)
        import torch

        seen["threads"] = torch.get_num_threads()
    Path(out).write_text(json.dumps(seen))
    print("to stdout")
    print("to stderr", file=sys.stderr)
    if "--wait" in rest:
        Path(rest[rest.index("--wait") + 1]).write_text(str(os.getpid()))
        while True:
            time.sleep(0.01)
    return code


if __name__ == "__main__":
    sys.exit(main())
