#!/usr/bin/env bash
# The main job on the embedded engine: set-up, a tiny local model (built once), a
# multi-agent generation run into runs/demo, then the dataset's stats.
# Rerunning resumes: prompts already in runs/demo are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/rollshard-generate init-model --preset tiny runs/tiny
.venv/bin/rollshard-generate --engine embedded:runs/tiny --agents multi_agent --task toy \
    --n-samples 4 --max-new-tokens 32 --limit 8 --out runs/demo
.venv/bin/rollshard-store stats runs/demo
cat <<'NEXT'

demo: done. Next:
  .venv/bin/rollshard-store inspect runs/demo                      # versions, groups; --sample ID for one row's tokens
  .venv/bin/rollshard-train --data runs/demo --model runs/tiny --out runs/train --groups-per-step 4
  .venv/bin/rollshard-generate --engine embedded:runs/train/checkpoints/latest --agents multi_agent --task toy \
      --n-samples 4 --max-new-tokens 32 --limit 8 --out runs/demo-round2   # generate with the trained policy
NEXT
