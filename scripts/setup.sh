#!/usr/bin/env bash
# Creates .venv with rollshard (editable) and its dev/notebook extras on the CPU torch build.
# Idempotent: a second run only re-checks the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints/cpu.txt -e '.[dev]'
.venv/bin/python -c "import rollshard.store, rollshard.generate, rollshard.train, torch; print('rollshard ready, torch', torch.__version__)"
