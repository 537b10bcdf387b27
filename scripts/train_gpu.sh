#!/usr/bin/env bash
# The next stage of the shipped SmolLM2 head on an accelerator: self-distilled replies, then training, then export.
#   bash scripts/train_gpu.sh [MODEL]        # MODEL: smollm2-135m-instruct (default) or a path to its .gguf
# Env: GEN_SECONDS (cap on reply generation, default none), TRAIN_SECONDS (cap on training: the trainer saves and
# stops on SIGTERM; run the script again to resume), PROMPTS (chat JSONL of first turns; default: ShareGPT),
# EXTRA (more --set overrides for both commands), DATA (where the replies go), SKIP_GEN=1 (train only).
# Generation reads the first 16,000 ShareGPT conversations: the later ones hold the sharegpt_heldout questions.
set -euo pipefail
MODEL=${1:-smollm2-135m-instruct}
CFG=configs/smollm2-135m-clover2-gpu.yaml
DATA=${DATA:-data/self_distill/smollm2-135m-instruct-sharegpt-gpu.jsonl.gz}  # a new file: the CPU stages' stay as they are
SD=${SD_DIR:-runs/sd}
set_model=(--set model.name_or_path="$MODEL" --set data.self_distill_dir="$SD")
read -r -a extra <<<"${EXTRA:-}"
cap() { if [ -n "$1" ]; then timeout -s TERM "$1" "${@:2}" || [ $? = 124 ]; else "${@:2}"; fi; }

if [ "${SKIP_GEN:-0}" != 1 ]; then
  cap "${GEN_SECONDS:-}" python -m clover_jax.training.self_distill --config $CFG "${set_model[@]}" \
      --set data.source="${PROMPTS:-sharegpt}" --set data.num_conversations=16000 "${extra[@]}"
  python -m clover_jax.training.self_distill --config $CFG "${set_model[@]}" --export-chat $DATA
fi
cap "${TRAIN_SECONDS:-}" python train.py --config $CFG --resume "${set_model[@]}" --set data.source="$DATA" "${extra[@]}"
