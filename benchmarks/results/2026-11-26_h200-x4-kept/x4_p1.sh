#!/usr/bin/env bash
# Issue 21, call P1 (tree: main cf00efb + kept-weights 72674e0): what takes bytes off the
# 4-GPU step's host memory. 7b at 16x1024 per GPU, 8 timed steps after 9:
# 1 GPU default; 4 GPUs default; 4 GPUs bf16 gradients (-4 B/param); 4 GPUs keep_weights=on
# (-4 B/param); 4 GPUs both. Carry build/calls; about 480 s (timeout_s 580).
export PYTHONUNBUFFERED=1
run() {  # name, timeout, devices, overrides...
  local name=$1 t=$2 dev=$3; shift 3
  CUDA_VISIBLE_DEVICES=$dev timeout $t python3 benchmarks/bench_step.py 7b --steps 8 \
    --warmup 9 --repeat-batch --no-roofline "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/$name.log | cut -c1-24 | tr '\n' ';'; echo
}
four="mesh.data=4 data.batch_size=64"
run p_1gpu 100 0 mesh.data=1
run p_4gpu 100 0,1,2,3 $four
run p_4gpu_g16 100 0,1,2,3 $four stream.grad_dtype=bfloat16
run p_4gpu_kw 100 0,1,2,3 $four stream.keep_weights=on
run p_4gpu_g16_kw 100 0,1,2,3 $four stream.grad_dtype=bfloat16 stream.keep_weights=on
for n in p_1gpu p_4gpu p_4gpu_g16 p_4gpu_kw p_4gpu_g16_kw; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','timed_steps_falling')})" 2>&1 | tail -1; done
