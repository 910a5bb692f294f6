#!/usr/bin/env bash
# Session 3, second H200 call. (1) The exported 0.9B model against transformers with
# full-precision fp32 matmuls on both sides (JAX's GPU default is TF32-like). (2) 7b step
# with the host optimizer's thread count at 16 (all cores) and 14 (two left for the
# runtime's transfer and dispatch threads). Results in $OUT/all.tgz.
set -u
OUT_FINAL=${OUT:-/tmp/out}
W=/tmp/t; mkdir -p $W
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{
timeout 200 python3 - <<'PY'
import torch, transformers as T
torch.manual_seed(0)
cfg = T.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                    num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                    max_position_embeddings=2048)
T.LlamaForCausalLM(cfg).save_pretrained("/tmp/t/hf_src", max_shard_size="1GB")
PY
for precision in default highest; do
  JAX_DEFAULT_MATMUL_PRECISION=$precision timeout 200 python3 benchmarks/hf_parity.py /tmp/t/hf_src
done
for threads in 16 14; do
  echo "== 7b, NUMBA_NUM_THREADS=$threads"
  NUMBA_NUM_THREADS=$threads timeout 240 python3 benchmarks/bench_step.py 7b --steps 6 --warmup 2 \
    --repeat-batch --phases 1 --out $W/step_7b_threads$threads.json > $W/step_7b_threads$threads.log 2>&1 \
    || { echo FAILED; grep -v '^W' $W/step_7b_threads$threads.log | tail -20; }
  python3 - "$W/step_7b_threads$threads.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); f = r["roofline"]
print(f"tokens/s {r['tokens_per_s']:,.0f}  step {r['median_step_s']:.3f} s  bound {f['step_s']:.3f} s"
      f"  ratio {f['ratio']:.3f}  optimizer {f['optimizer_gparams']:.2f} G/s  "
      f"GPU {r['peak_device_gib']:.2f} GiB")
PY
done
} 2>&1 | grep -v '^W' | tee $W/summary.txt
cd /tmp && tar czf "$OUT_FINAL/all.tgz" --exclude='*.safetensors' t
