#!/usr/bin/env bash
# Trains every draft-head type on the same data for the same number of steps (an equal training budget: the same
# examples in the same order, batch 4, the same trained positions), each from its own fresh initialisation and
# with its own recipe's loss (configs/smollm2-135m-<head>.yaml), then compares them on MT-Bench:
#   bash scripts/compare_heads.sh                      # all heads, 300 steps each
#   STEPS=600 HEADS="clover2 eagle" bash scripts/compare_heads.sh
#   CORES=1 bash scripts/compare_heads.sh              # pin the training to core 1 (leave core 0 free)
#   CONVERSATIONS=1200 bash scripts/compare_heads.sh   # the first 1,200 kept replies only (0: all 2,144)
# The base features are computed once (runs/feature_cache) and shared by the runs. Runs go to runs/compare-<head>;
# the table comes from bench/compare_heads.py (which also runs alone on runs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
STEPS=${STEPS:-300}
HEADS=${HEADS:-"clover2 eagle medusa clover1 redrafter block"}
CONVERSATIONS=${CONVERSATIONS:-0}
pin=()
if [[ -n "${CORES:-}" ]]; then pin=(taskset -c "$CORES"); fi
for h in $HEADS; do
  run=runs/compare-$h
  if [[ -f $run/train_summary.jsonl ]]; then echo "[compare] $run done: skipped"; continue; fi
  resume=()
  if [[ -d $run/checkpoints ]]; then resume=(--resume); fi
  "${pin[@]}" python train.py --config "configs/smollm2-135m-$h.yaml" --output-dir "$run" --quiet "${resume[@]}" \
    --set data.source=data/self_distill/smollm2-135m-instruct-sharegpt.jsonl.gz --set data.self_distill=false \
    --set data.num_conversations="$CONVERSATIONS" --set train.steps="$STEPS" --set train.eval_every="$STEPS" \
    --set checkpoint.save_every=100 --set train.feature_cache_dir=runs/feature_cache | tee "runs/compare-$h.log"
  tail -n 2 "runs/compare-$h.log" > "$run/train_summary.jsonl"  # the run's summary (steps, time, tokens/s, eval)
done
python bench/compare_heads.py ${HEADS// / } --runs runs --prefix compare- "$@"
