# Device call 2 of the twenty-eighth session (one NVIDIA H200), as run: BUDGET=450 bash <this file>.
# Call 1 had put the first xz part of the SmolLM2 GGUF in /root/gg and the gguf wheel in /root/site; this call
# carried the second part (.gpu/gg.xz.partab). Stage 11 of the Clover-2 head: a warm start from the shipped head at
# lr 1e-3, batch 128, on the six self-distilled files (configs/smollm2-135m-clover2-stage11.yaml).
set -uo pipefail
export PYTHONPATH=$PWD:/root/site PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-450}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
date; nvidia-smi -L
cat /root/gg/gg.xz.partaa .gpu/gg.xz.partab | xz -d -T0 > /root/gg/smol.gguf; sha256sum /root/gg/smol.gguf
G=/root/gg/smol.gguf
C=(--config configs/smollm2-135m-clover2-stage11.yaml --set model.name_or_path=$G)
L=$(left); STEPS=$(( (L - 130) * ${SPS:-15} / 2 )); echo "== training: left $L s -> $STEPS steps"
timeout -s TERM $(( L - 50 )) python3 train.py "${C[@]}" --set train.steps=$STEPS 2>&1 \
  | tr '\r' '\n' | grep -v "it/s\]$" | grep -v "step/s\]$" | tee $OUT/train11.txt | tail -30
date
python3 -m clover_jax.export head --checkpoint runs/smollm2-135m-clover2-stage11 --no-embedding --dtype float32 \
  --out runs/c2s11 --overwrite 2>&1 | tail -2
(cd runs && tar cf - c2s11 | xz -1 -T0 | split -b 15000000 - $OUT/c2s11.tar.xz.)
ls -la $OUT; date
