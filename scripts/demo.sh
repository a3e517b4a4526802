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
  .venv/bin/rollshard-store inspect runs/demo                      # versions, groups; --sample first|random|ID: one row's tokens
  .venv/bin/rollshard-store report runs/demo --out runs/demo.html  # the notebook's views as one HTML page
  .venv/bin/rollshard-train --data runs/demo --model runs/tiny --out runs/train --groups-per-step 4
  .venv/bin/rollshard-generate --engine embedded:runs/train/checkpoints/latest --agents multi_agent --task toy \
      --n-samples 4 --max-new-tokens 32 --limit 8 --out runs/demo-round2   # generate with the trained policy
  .venv/bin/rollshard-loop --model runs/tiny --out runs/loop --rounds 3 --generate "--task toy --n-samples 16 \
      --max-new-tokens 16" --train "--groups-per-step 2 --num-epochs 3 --lr 5e-3 --mode decoupled"   # all of it, 3 rounds
NEXT
