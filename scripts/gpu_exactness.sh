#!/usr/bin/env bash
# Exactness and speed on an accelerator, audited, in one short run: greedy speculative decoding against
# autoregressive decoding on MT-Bench with what a request gets by default (`chosen`: the tree chosen for this card),
# the shipped Clover-2 head's default tree, chain-3 and the 26-token tree; every output that differs from
# autoregressive decoding classified (near-tie or unexplained) and every emitted token certified by a float32 replay
# (bench/bench_spec.py --replay, clover_jax.tuning.audit).
#
#   bash scripts/gpu_exactness.sh [OUT]          # LIMIT=80 prompts (default), CAP=270 seconds per dtype
#
# Compiles are what an accelerator run pays for (about 15-20 s per unrolled SmolLM2 loop on an H200), so each run
# compiles a fixed, small set of programs: every prompt padded to one bucket (--prompt-bucket 512: MT-Bench's
# longest first turn fits), so each loop is one program, and every program compiled before the first timed call,
# WARM at a time (--warmup-threads). Per dtype: 5 decoding loops (AR, chosen, default tree, chain-3, clover2-26),
# the choice's own 5 (compiled side by side, then timed one at a time), and the float32 replay's few length buckets.
# Runs, each written to OUT/<run>/results.json and results.md, one summary line each in OUT/summary.txt, and each
# copied into results/<date>-<card>-mt_bench-<LIMIT>-<dtype>-audit.json (render with scripts/render_results.py):
#   float32      float32 products (what generate asks for), layers as the card's default
#   bfloat16     bfloat16 compute
# Dry-run end to end on a 2-core CPU (LIMIT=1 WARM=2): float32 146 s, bfloat16 186 s, 0 of 4 outputs differing, every
# token certified. On an H200 the time per dtype is an estimate from the compile count above at 15-20 s a program,
# not a measurement. A dry run on a CPU: LIMIT=1 WARM=2 bash scripts/gpu_exactness.sh /tmp/gpu_dry (it also writes
# its results into results/: delete them, they are not a GPU run)
set -uo pipefail
OUT=${1:-runs/gpu_exactness}
LIMIT=${LIMIT:-80}
CAP=${CAP:-270}
WARM=${WARM:-8}
BUCKET=${BUCKET:-512}
PY=${PYTHON:-$(command -v python3 || command -v python)}
TREES="chosen fit-5-411aab+lookup-4-table chain-3 clover2-26"
mkdir -p "$OUT"
: > "$OUT/summary.txt"
START=$(date +%s)
run() {  # name, dtype
  local name=$1 dtype=$2 t0
  t0=$(date +%s)
  echo "## $name" | tee -a "$OUT/summary.txt"
  timeout "$CAP" "$PY" bench/bench_spec.py --questions mt_bench --limit "$LIMIT" --trees $TREES --dtype "$dtype" \
      --max-new-tokens 128 --replay --prompt-bucket "$BUCKET" --warmup-threads "$WARM" --out "$OUT/$name/results.json" \
      > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  if [ -f "$OUT/$name/results.md" ]; then
    grep -E "^\| |differing|audit:|replay|compile" "$OUT/$name/results.md" | tee -a "$OUT/summary.txt"
    "$PY" - "$OUT/$name/results.json" "$dtype" "$LIMIT" "$BUCKET" "$WARM" <<'EOF'
import json, sys, time
from pathlib import Path

path, dtype, limit, bucket, warm = sys.argv[1:]
r = json.loads(Path(path).read_text())
card = r["machine"].split("gpu: ")[-1].split(",")[0].strip() if "gpu: " in r["machine"] else r["machine"].split(",")[0]
slug = card.lower().replace("nvidia ", "").replace(" ", "-")
r.update(title=f"MT-Bench {limit}, one {card}, {dtype}, audited", questions=f"MT-Bench {limit}",
         date=time.strftime("%Y-%m-%d"), machine_short=f"one {card}", benchmark="bench_spec",
         settings=f"SmolLM2-135M-Instruct in {dtype}, the shipped heads, greedy, 128 new tokens, batch 1, prompts padded "
                  f"to {bucket} tokens, programs compiled before timing ({warm} at a time)",
         command=f"LIMIT={limit} bash scripts/gpu_exactness.sh", source="results.json of bench/bench_spec.py --out")
out = Path("results") / f"{r['date']}-{slug}-mt_bench-{limit}-{dtype}-audit.json"
out.write_text(json.dumps(r, indent=1))
print(f"wrote {out}")
EOF
  else
    tr '\r' '\n' < "$OUT/$name.log" | grep -v "eval:" | tail -5 | tee -a "$OUT/summary.txt"
  fi
}
run float32 float32
run bfloat16 bfloat16
echo "total: $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
