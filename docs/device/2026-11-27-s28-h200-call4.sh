# Device call 4 of the twenty-eighth session (one NVIDIA H200): more replies sampled at T=0.7 (seed 3) for the prompts
# of .gpu/prompts_gen.jsonl.gz (data/self_distill/README.md), capped at GEN seconds, exported with ids X/t0.7d.
set -uo pipefail
export PYTHONPATH=$PWD:/root/site PYTHONUNBUFFERED=1
date
G=/root/gg/smol.gguf
C=(--config configs/smollm2-135m-eagle-gpu.yaml --set model.name_or_path=$G)
NEW=data/self_distill/smollm2-135m-instruct-sharegpt-t0.7d.jsonl.gz
timeout -s TERM ${GEN:-115} python3 -m clover_jax.training.self_distill "${C[@]}" --set data.self_distill_dir=runs/sd_t07d \
  --set data.source=.gpu/prompts_gen.jsonl.gz --set data.num_conversations=0 --set data.self_distill_temperature=0.7 \
  --set data.seed=3 --set data.self_distill_batch_size=1024 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -4
python3 -m clover_jax.training.self_distill "${C[@]}" --set data.self_distill_dir=runs/sd_t07d --export-chat $NEW --id-suffix /t0.7d 2>&1 | tail -2
cp $NEW $OUT/ 2>/dev/null; ls -la $OUT; date
