#!/usr/bin/env bash
# The decode step on one GPU, in one short run: Llama-3-8B's shapes in bfloat16 (random weights, no download),
# context 300, cache 640, from the compiled loops (bench/bench_step.py bytes): ms per step of the autoregressive
# loop and of the speculative loops of chain-3 and clover2-26 (a random Clover-2 head), unrolled and scanned layers,
# batch 1 and 8; XLA's bytes accessed per step against the weights' and the KV cache's bytes; the memory a call
# holds (memory_analysis: arguments, temporaries; the device's peak); and what XLA flags buy: dynamic-slice fusion
# for the scanned layers (cuBLAS reading each layer's slice in place, one copy of the weights without unrolling),
# and command buffers (CUDA graphs) over the whole while loop for SmolLM2's shapes, whose steps are launch-bound.
#
#   bash scripts/gpu_step.sh [OUT]               # OUT default: $OUT if set, else runs/gpu_step
#   TINY=1 bash scripts/gpu_step.sh /tmp/gs     # tiny shapes: checks on a CPU that every run goes end to end
#
# Compiles are what the run pays for (about 15-20 s per unrolled 8B-shaped loop on an H200), so each run compiles a
# fixed set of programs, counted and printed (one per loop and batch, one more per loop for its step's cost analysis
# at batch 1): 12 + 3 + 2 + 3 x 1 = 20 programs, 6 of them unrolled 8B-shaped loops and 3 their steps. Runs, each a
# process of its own (XLA flags are per process), each written to OUT/<run>.json and its table to OUT/<run>.log,
# one summary in OUT/summary.txt:
#   8b-b1        AR, chain-3, clover2-26; unrolled and scan; batch 1; steps' cost analysis; timed
#   8b-b8        the same loops unrolled at batch 8, timed
#   8b-dsf       scan with --xla_gpu_enable_dynamic_slice_fusion=true: AR and clover2-26, batch 1, timed
#   smol-cb-*    SmolLM2-135M's shapes, float32, the AR loop unrolled, batch 1, timed, under three command-buffer
#                settings: XLA's default, none (--xla_gpu_enable_command_buffer=), and every command type including
#                the while loop and its condition (FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONDITIONAL,WHILE, graphs of
#                any size)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT=${1:-${OUT:-runs/gpu_step}}
PY=${PYTHON:-$(command -v python3 || command -v python)}
CAP=${CAP:-240}  # seconds per run at most
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export CLOVER_JAX_COMPILE_CACHE=off  # every program compiled here, none written to the persistent cache
if [ "${TINY:-0}" = 1 ]; then
  BIG="--shape tiny --context 20 --cache-size 256 --loop-tokens 4 12 --loop-repeat 1 --draft-vocab 0"
  SMALL="$BIG"
else
  BIG="--shape llama3-8b --dtype bfloat16 --context 300 --cache-size 640"
  SMALL="--shape smollm2-135m --dtype float32 --context 300 --cache-size 640"
fi
ALL_CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1"
START=$(date +%s)
run() {  # name, XLA_FLAGS, bench arguments...
  local name=$1 flags=$2 t0
  shift 2
  t0=$(date +%s)
  echo "## $name (XLA_FLAGS='$flags')" | tee -a "$OUT/summary.txt"
  XLA_FLAGS="$flags" timeout "$CAP" "$PY" bench/bench_step.py bytes "$@" --time --label "$name" \
      --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  grep -E "^\| |^# " "$OUT/$name.log" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log" | grep -iE "error|Traceback" | tee -a "$OUT/summary.txt"
}
run 8b-b1 "" $BIG --trees chain-3 clover2-26 --layers unrolled scan --batch-sizes 1
run 8b-b8 "" $BIG --trees chain-3 clover2-26 --layers unrolled --batch-sizes 8 --no-step
run 8b-dsf "--xla_gpu_enable_dynamic_slice_fusion=true" $BIG --trees clover2-26 --layers scan --batch-sizes 1 --no-step
run smol-cb-default "" $SMALL --trees --layers unrolled --batch-sizes 1 --no-step
run smol-cb-none "--xla_gpu_enable_command_buffer=" $SMALL --trees --layers unrolled --batch-sizes 1 --no-step
run smol-cb-all "$ALL_CB" $SMALL --trees --layers unrolled --batch-sizes 1 --no-step
echo "programs compiled: $(cat "$OUT"/*.log | grep -oE '^# [0-9]+ programs' | awk '{s += $2} END {print s}')," \
     "total $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
