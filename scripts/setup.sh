#!/usr/bin/env bash
# Creates .venv with rollshard (editable) and its dev/notebook extras on the CPU torch build, and makes sure
# Chromium (Debian's) is there for the HTML report's browser test. Idempotent: a second run only re-checks.
#
# The first .venv built on a machine is kept as a copy outside the checkout, keyed by what decides its contents
# (the Python, pyproject.toml, constraints/cpu.txt), as the SGLang venv is: a fresh clone's set-up copies it (about
# 20-30 s) instead of installing every package again (about 2 minutes on 2 cores), then installs rollshard itself.
#   ROLLSHARD_VENV_CACHE=DIR   keep it as DIR/venv-dev-<key> (default DIR: ${XDG_CACHE_HOME:-~/.cache}/rollshard)
#   ROLLSHARD_VENV_CACHE=off   neither read nor keep a copy
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
KEY=$({ "$PY" -VV; cat pyproject.toml constraints/cpu.txt; } | sha256sum | cut -c1-16)
CACHED=off
if [ "${ROLLSHARD_VENV_CACHE:-}" != off ]; then
    CACHED=${ROLLSHARD_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollshard}/venv-dev-$KEY
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

cached_ok() {
    [ "$CACHED" != off ] && [ -x "$CACHED/bin/python" ] && "$CACHED/bin/python" -c "import torch" 2>/dev/null
}

if [ -x .venv/bin/python ]; then
    echo "setup: 1/4 .venv exists"
    install=full
elif [ ! -e .venv ] && cached_ok && "$PY" scripts/copy_venv.py "$CACHED" .venv; then
    echo "setup: 1/4 copied .venv from this machine's copy of it ($CACHED)"
    install=editable
else
    echo "setup: 1/4 creating .venv"
    "$PY" -m venv .venv
    install=fresh
fi
if [ "$install" = editable ]; then
    echo "setup: 2/4 installing rollshard (editable); its dependencies came with the copy"
    "${PIP[@]}" --no-deps --no-build-isolation -e .
else
    echo "setup: 2/4 installing rollshard (editable) with its dev extras on the CPU torch (a few minutes the first time)"
    "${PIP[@]}" -c constraints/cpu.txt -e '.[dev]'
fi
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
if [ "$install" = fresh ] && [ "$CACHED" != off ] && ! cached_ok; then
    need_kb=$(( $(du -sk .venv | cut -f1) * 2 ))  # the copy, and room left beside it
    mkdir -p "$(dirname "$CACHED")"
    if [ "$(df -Pk "$(dirname "$CACHED")" | awk 'NR==2 {print $4}')" -gt "$need_kb" ]; then
        echo "setup: keeping a copy of .venv for the next clone's set-up: $CACHED"
        rm -rf "$CACHED"  # a copy that does not work
        "$PY" scripts/copy_venv.py .venv "$CACHED" \
            || echo "setup: could not keep a copy at $CACHED (the next set-up installs again)"
    else
        echo "setup: not keeping a copy of .venv (less than $(( need_kb / 1048576 )) GB free at $(dirname "$CACHED"))"
    fi
fi
echo "setup: the commands are in .venv/bin (rollshard-generate, rollshard-store, rollshard-train, rollshard-loop); run them from there, or 'source .venv/bin/activate' first"
