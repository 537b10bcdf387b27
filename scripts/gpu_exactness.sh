#!/usr/bin/env bash
# Exactness on an accelerator, audited: greedy speculative decoding against autoregressive decoding on MT-Bench, the
# shipped Clover-2 head's default tree, chain-3 and the 26-token tree, every output certified by a float32 replay
# (bench/bench_spec.py --replay; clover_jax.tuning.audit classifies each divergence as a near-tie or unexplained).
#
#   bash scripts/gpu_exactness.sh [OUT]          # LIMIT=80 prompts (default), CAP=150 seconds per run
#
# Runs, each written to OUT/<run>/results.json and results.md, one summary line each in OUT/summary.txt:
#   float32-highest-unrolled   float32 products (what generate asks for), layers unrolled (a GPU's default)
#   float32-default-unrolled   the backend's default matmul precision (TF32 on recent NVIDIA GPUs), same card
#   float32-highest-scan       layers scanned
#   bfloat16-unrolled          bfloat16 compute
#   precision-cost             bench/bench_precision.py: tokens and time of float32 products against the default
# About 8 minutes on an H200 at LIMIT=80 (mostly compiles); LIMIT=40 halves the decoding part.
set -uo pipefail
OUT=${1:-runs/gpu_exactness}
LIMIT=${LIMIT:-80}
CAP=${CAP:-150}
PY=${PYTHON:-$(command -v python3 || command -v python)}
TREES="fit-5-411aab+lookup-4-table chain-3 clover2-26"
mkdir -p "$OUT"
: > "$OUT/summary.txt"
run() {  # name, dtype, layers, extra environment
  local name=$1 dtype=$2 layers=$3
  shift 3
  echo "## $name"
  env "$@" timeout "$CAP" "$PY" bench/bench_spec.py --questions mt_bench --limit "$LIMIT" --trees $TREES \
      --dtype "$dtype" --layers "$layers" --max-new-tokens 128 --replay --out-dir "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?" >> "$OUT/summary.txt"
  if [ -f "$OUT/$name/results.md" ]; then
    grep -E "^\| |differing|audit:|replay" "$OUT/$name/results.md" | tee -a "$OUT/summary.txt"
  else
    tr '\r' '\n' < "$OUT/$name.log" | grep -v "eval:" | tail -5 | tee -a "$OUT/summary.txt"
  fi
}
run float32-highest-unrolled float32 unrolled
run float32-default-unrolled float32 unrolled JAX_DEFAULT_MATMUL_PRECISION=default
run float32-highest-scan float32 scan
run bfloat16-unrolled bfloat16 unrolled
echo "## precision-cost" | tee -a "$OUT/summary.txt"
timeout "$CAP" "$PY" bench/bench_precision.py --limit 8 --max-new-tokens 64 --tree chain-3 > "$OUT/precision-cost.log" 2>&1
tail -6 "$OUT/precision-cost.log" | tee -a "$OUT/summary.txt"
