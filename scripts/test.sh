#!/usr/bin/env bash
# The test command: set-up, the default tier, the slow tier (whole loop runs, Ray clusters), then the real-SGLang tier in its own venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
.venv/bin/python -m pytest -q -m slow "$@"
bash scripts/make_sglang_env.sh
ROLLSHARD_REQUIRE_SGLANG=1 .venv/bin/python -m pytest -q -m sglang "$@"
