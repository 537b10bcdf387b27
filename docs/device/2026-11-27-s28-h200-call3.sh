# Device call 3 of the twenty-eighth session (one NVIDIA H200): the n-gram table's loop-free search on a GPU, with the
# stage-11 Clover-2 head (HEAD=runs/c2s11, NG="--ngram-table clover_jax/pretrained/smollm2-135m-instruct-clover2"), float32, unrolled layers, 10 MT-Bench humanities prompts.
set -uo pipefail
export PYTHONPATH=$PWD:/root/site PYTHONUNBUFFERED=1
date
timeout -s TERM ${CAP:-200} python3 bench/bench_spec.py --model /root/gg/smol.gguf --head ${HEAD:-smollm2-135m-instruct-clover2} ${NG:-} \
  --questions mt_bench --category humanities --trees chain-3 chain-3+lookup-4-table ${EXTRA:-} --layers unrolled \
  --max-new-tokens 128 --out-dir $OUT/bench 2>&1 | grep -v "it/s\]$" | tail -25
ls -la $OUT $OUT/bench 2>/dev/null; date
