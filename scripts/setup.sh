#!/usr/bin/env bash
# Creates .venv with rollshard (editable) and its dev/notebook extras on the CPU torch build.
# Idempotent: a second run only re-checks the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then
    echo "setup: 1/3 .venv exists"
else
    echo "setup: 1/3 creating .venv"
    "$PY" -m venv .venv
fi
echo "setup: 2/3 installing rollshard (editable) with its dev extras on the CPU torch (a few minutes the first time)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints/cpu.txt -e '.[dev]'
echo "setup: 3/3 checking the install"
.venv/bin/python -c "import rollshard.store, rollshard.generate, rollshard.train, torch; print('rollshard ready, torch', torch.__version__)"
echo "setup: the commands are in .venv/bin (rollshard-generate, rollshard-store, rollshard-train); run them from there, or 'source .venv/bin/activate' first"
