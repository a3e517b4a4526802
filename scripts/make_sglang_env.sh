#!/usr/bin/env bash
# Build the separate SGLang environment the `sglang`-marked tests launch the real server from.
#
# SGLang pins its own torch build, which cannot live beside the project's CPU torch, so it
# gets its own venv. It is about 11 GB, so it lives once per machine, keyed by the SGLang
# version, outside any checkout: every clone of the repository (CI's included) reuses it.
# Idempotent: does nothing when the venv already imports the pinned sglang (checked once, then its stamp file).
#
#   scripts/make_sglang_env.sh            # builds $ROLLSHARD_SGLANG_VENV
#   scripts/make_sglang_env.sh --path     # prints where it is (what tests/conftest.py launches)
#   ROLLSHARD_SGLANG_VENV=/opt/sgl scripts/make_sglang_env.sh
#
# Default location: ${XDG_CACHE_HOME:-~/.cache}/rollshard/venv-sglang-<version>.
# A build that fails (no disk, no network) removes what it wrote, so a retry starts clean.
set -euo pipefail

SGLANG_VERSION="${ROLLSHARD_SGLANG_VERSION:-0.5.23}"
VENV="${ROLLSHARD_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rollshard/venv-sglang-$SGLANG_VERSION}"
NEED_GB=14  # the venv, plus pip's unpacking room
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

if [ "${1:-}" = "--path" ]; then
    echo "$VENV"
    exit 0
fi

# Written once `import sglang` gave the pinned version in this venv (a build's last step): later checks read it
# instead of importing sglang again (~8 s of every test run).
STAMP="$VENV/.rollshard-sglang-ready"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$SGLANG_VERSION" ]; then
    echo "sglang environment ready: $VENV ($SGLANG_VERSION)"
    exit 0
fi
if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c 'import sglang; print(sglang.__version__)' 2>/dev/null)" = "$SGLANG_VERSION" ]; then
    echo "$SGLANG_VERSION" 2>/dev/null > "$STAMP" || true  # a venv this user cannot write to is checked each time
    echo "sglang environment ready: $VENV ($SGLANG_VERSION)"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
free_gb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print int($4 / 1048576)}')
if [ "$free_gb" -lt "$NEED_GB" ]; then
    echo "error: the SGLang environment needs about $NEED_GB GB free at $(dirname "$VENV"), and $free_gb GB are;" \
         "free some space or point ROLLSHARD_SGLANG_VENV at a larger disk" >&2
    exit 1
fi

echo "building sglang==$SGLANG_VERSION environment in $VENV"
rm -rf "$VENV"
trap 'rm -rf "$VENV"; echo "error: building the SGLang environment failed; removed $VENV" >&2' ERR
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --no-cache-dir --upgrade pip
"$VENV/bin/python" -m pip install --no-cache-dir "sglang==$SGLANG_VERSION"
[ "$("$VENV/bin/python" -c 'import sglang; print(sglang.__version__)')" = "$SGLANG_VERSION" ]
echo "$SGLANG_VERSION" > "$STAMP"
trap - ERR
echo "sglang environment ready: $VENV ($SGLANG_VERSION)"
