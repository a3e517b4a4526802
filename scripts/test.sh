#!/usr/bin/env bash
# The test command: set-up, the default tier, the docs and slow tiers together (the README's and docs/'s command
# blocks beside the whole loop runs and Ray clusters), then the real-SGLang tier in its own venv.
# Both pytest runs use two pytest-xdist workers, each module's tests on one worker (its module fixtures built once;
# the docs blocks in reading order): the docs tier is one long chain of blocks, so the slow tier's modules run on
# the other worker meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -n 2 --dist loadscope "$@"
.venv/bin/python -m pytest -q -n 2 --dist loadscope -m "docs or slow" "$@"
bash scripts/make_sglang_env.sh
ROLLSHARD_REQUIRE_SGLANG=1 .venv/bin/python -m pytest -q -m sglang "$@"
