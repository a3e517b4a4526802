#!/usr/bin/env bash
# The test command: set-up, the default tier, the docs tier (the README's and docs/'s command blocks), the slow tier (whole loop runs, Ray clusters), then the real-SGLang tier in its own venv.
# The default tier runs on two pytest-xdist workers, each module's tests on one worker (its module fixtures built
# once); the slow tier's runs already keep both cores busy, so it runs on one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -n 2 --dist loadscope "$@"
.venv/bin/python -m pytest -q -m docs "$@"
.venv/bin/python -m pytest -q -m slow "$@"
bash scripts/make_sglang_env.sh
ROLLSHARD_REQUIRE_SGLANG=1 .venv/bin/python -m pytest -q -m sglang "$@"
