#!/usr/bin/env bash
# The test command: set-up, the default tier, the docs and slow tiers together (the README's and docs/'s command
# blocks beside the whole loop runs and Ray clusters), then the real-SGLang tier in its own venv.
# Both pytest runs use pytest-xdist workers, each module's tests on one worker (its module fixtures built once;
# the docs blocks in reading order). The default tier runs three workers on two cores: the third fills the gaps where a
# test waits on a process it started, and the tail where one module runs alone (6:36-6:50 against 7:22-7:40 with
# two, docs/performance.md). The docs and slow tiers run two: their tests are whole multi-process runs that keep
# both cores busy (four workers took as long, and a Ray cluster beside three others four times as long); the docs
# tier is one long chain of blocks, so the slow tier's modules run on the other worker meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -n 3 --dist loadscope "$@"
.venv/bin/python -m pytest -q -n 2 --dist loadscope -m "docs or slow" "$@"
bash scripts/make_sglang_env.sh
ROLLSHARD_REQUIRE_SGLANG=1 .venv/bin/python -m pytest -q -m sglang "$@"
