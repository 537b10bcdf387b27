#!/usr/bin/env bash
# Greedy speculative decoding against autoregressive decoding on this machine's accelerator, for both ways of
# running the layers and both dtypes: the check to run first on a GPU. Exactness on GPUs is not established: float32
# with unrolled layers has been checked on one GPU on MT-Bench's 10 humanities questions only (docs/results.md);
# float32 with scanned layers and with the 26-token tree has not been run on a GPU. In bfloat16,
# speculative output differs from autoregressive output on CPUs and GPUs alike (verify and decode shapes round
# differently), so only the float32 runs test exactness.
#   bash scripts/gpu_exactness.sh [MODEL] [OUT]   # MODEL: smollm2-135m-instruct (default) or a path to its .gguf
# Each run prints its table and which prompts differ per tree; a minute or two each on a GPU (mostly compiling).
set -uo pipefail
MODEL=${1:-smollm2-135m-instruct}
OUT=${2:-runs/gpu_exactness}
PY=${PYTHON:-$(command -v python3 || command -v python)}
for run in "float32 unrolled" "float32 scan" "bfloat16 unrolled"; do
  set -- $run
  echo "## $1, layers $2"
  timeout "${CAP:-240}" $PY bench/bench_spec.py --model "$MODEL" --questions mt_bench --category humanities \
      --trees chain-3 clover2-26 --dtype "$1" --layers "$2" --max-new-tokens 128 --out-dir "$OUT/$1-$2" 2>&1 \
      | tr '\r' '\n' | grep -v "eval:" | tail -12
done
echo "## float32: asked float32 products against the backend's default (outputs and time)"
timeout "${CAP:-240}" $PY bench/bench_precision.py --model "$MODEL" --limit 8 --max-new-tokens 64 2>&1 | tail -6
