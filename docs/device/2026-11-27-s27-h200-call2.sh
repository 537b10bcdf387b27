# Device call 2 of the twenty-seventh session (one NVIDIA H200), as run: BUDGET=560 bash <this file>.
# Call 1 had put the first xz part of the SmolLM2 GGUF in /root/gg and the gguf wheel in /root/site; this call
# carried the second part (.gpu/gg.xz.partab) and the prompts to sample (.gpu/prompts_gen.jsonl.gz: the 7,973 of
# the 12,897 usable ShareGPT prompts with fewer than two sampled replies, data/self_distill/README.md).
set -uo pipefail
export PYTHONPATH=$PWD:/root/site PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-540}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
date; nvidia-smi -L
cat /root/gg/gg.xz.partaa .gpu/gg.xz.partab | xz -d -T0 > /root/gg/smol.gguf; sha256sum /root/gg/smol.gguf
G=/root/gg/smol.gguf
C=(--config configs/smollm2-135m-eagle-gpu.yaml --set model.name_or_path=$G)
DS=data/self_distill/smollm2-135m-instruct-sharegpt
NEW=$DS-t0.7c.jsonl.gz
echo "== generation (cap ${GEN:-110} s)"
timeout -s TERM ${GEN:-110} python3 -m clover_jax.training.self_distill "${C[@]}" --set data.self_distill_dir=runs/sd_t07c \
  --set data.source=.gpu/prompts_gen.jsonl.gz --set data.num_conversations=0 --set data.self_distill_temperature=0.7 \
  --set data.seed=2 --set data.self_distill_batch_size=${GBS:-1024} 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -6
python3 -m clover_jax.training.self_distill "${C[@]}" --set data.self_distill_dir=runs/sd_t07c --export-chat $NEW --id-suffix /t0.7c
srcs="$DS.jsonl.gz,$DS-2.jsonl.gz,$DS-3.jsonl.gz,$DS-t0.7.jsonl.gz,$DS-t0.7b.jsonl.gz"
if [ "$(zcat $NEW | head -c1 | wc -c)" = 1 ]; then cp $NEW $OUT/; srcs="$srcs,$NEW"; fi
date
L=$(left); STEPS=$(( (L - 110) * 17 )); echo "== training: left $L s -> $STEPS steps"
timeout -s TERM $(( L - 45 )) python3 train.py "${C[@]}" --set data.source="[$srcs]" \
  --set train.init_head_from=smollm2-135m-instruct-eagle --set train.draft_vocab_from=smollm2-135m-instruct-eagle \
  --set train.output_dir=runs/eagle-gpu-3 --set optim.warmup_steps=100 --set train.steps=$STEPS 2>&1 \
  | tr '\r' '\n' | grep -v "it/s\]$" | grep -v "step/s\]$" | tee $OUT/train3.txt | tail -30
date
python3 -m clover_jax.export head --checkpoint runs/eagle-gpu-3 --no-embedding --dtype float32 --out runs/eagle_gpu3 --overwrite 2>&1 | tail -2
(cd runs && tar cf - eagle_gpu3 | xz -1 -T0 | split -b 15000000 - $OUT/eagle3.tar.xz.)
ls -la $OUT; date
