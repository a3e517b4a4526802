"""``python -m tests.run_code CODE``: runs CODE as ``python -c CODE`` does, so that a test's command with a patch
run before it can be a fork of the warm server (tests/forked.py)."""

import sys

if __name__ == "__main__":
    code, sys.argv = sys.argv[1], ["-c", *sys.argv[2:]]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
