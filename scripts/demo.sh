#!/usr/bin/env bash
# The main job: sets up .venv, then generates from the real SmolLM2-135M-Instruct and reports tokens/s.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/env.sh
exec python infer.py --model smollm2-135m-instruct --prompts-file ../shared/data/mt_bench/question.jsonl \
  --limit 3 --max-new-tokens 128 "$@"
