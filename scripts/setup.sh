#!/usr/bin/env bash
# Creates .venv with rollshard (editable) and its dev/notebook extras on the CPU torch build, and makes sure
# Chromium (Debian's) is there for the HTML report's browser test. Idempotent: a second run only re-checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then
    echo "setup: 1/4 .venv exists"
else
    echo "setup: 1/4 creating .venv"
    "$PY" -m venv .venv
fi
echo "setup: 2/4 installing rollshard (editable) with its dev extras on the CPU torch (a few minutes the first time)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints/cpu.txt -e '.[dev]'
if command -v chromium >/dev/null 2>&1; then
    echo "setup: 3/4 chromium found ($(command -v chromium))"
else
    echo "setup: 3/4 installing Chromium from the system's packages (the report's browser test drives it)"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    if [ -n "$SUDO" ] && ! command -v sudo >/dev/null 2>&1; then
        echo "setup: cannot install chromium (not root, no sudo); install it (apt-get install chromium) or the browser test fails"
    elif command -v apt-get >/dev/null 2>&1; then
        $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
            || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
    else
        echo "setup: no apt-get here; install Chromium with your package manager, or the browser test fails"
    fi
fi
echo "setup: 4/4 checking the install"
.venv/bin/python -c "import rollshard.store, rollshard.generate, rollshard.train, torch; print('rollshard ready, torch', torch.__version__)"
echo "setup: the commands are in .venv/bin (rollshard-generate, rollshard-store, rollshard-train, rollshard-loop); run them from there, or 'source .venv/bin/activate' first"
