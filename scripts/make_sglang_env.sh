#!/usr/bin/env bash
# Build the separate SGLang environment the `sglang`-marked tests launch the real server from.
#
# SGLang pins its own torch build, which cannot live beside the project's CPU torch, so it
# gets its own venv. Idempotent: does nothing when the venv already imports sglang.
#
#   scripts/make_sglang_env.sh            # builds $ROLLSHARD_SGLANG_VENV (default .venv-sglang next to this repo)
#   ROLLSHARD_SGLANG_VENV=/opt/sgl scripts/make_sglang_env.sh
#
# About 11 GB and a few minutes; pip takes the pinned torch wheel from local disk when present.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROLLSHARD_SGLANG_VENV:-$REPO/.venv-sglang}"
SGLANG_VERSION="${ROLLSHARD_SGLANG_VERSION:-0.5.23}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import sglang" >/dev/null 2>&1; then
    echo "sglang environment ready: $VENV ($("$VENV/bin/python" -c 'import sglang; print(sglang.__version__)'))"
    exit 0
fi

echo "building sglang==$SGLANG_VERSION environment in $VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install "sglang==$SGLANG_VERSION"
"$VENV/bin/python" -c "import sglang; print('sglang environment ready:', '$VENV', sglang.__version__)"
