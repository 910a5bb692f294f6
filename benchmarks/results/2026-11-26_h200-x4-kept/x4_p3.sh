#!/usr/bin/env bash
# Issue 21, call P3 (same tree as P2): one GPU with stream.keep_weights=on, then the default
# again (P2's one-GPU run was 1.84 s a step against 1.74 in X4F). About 200 s.
export PYTHONUNBUFFERED=1
run() {  # name, timeout, devices, overrides...
  local name=$1 t=$2 dev=$3; shift 3
  CUDA_VISIBLE_DEVICES=$dev timeout $t python3 benchmarks/bench_step.py 7b --steps 6 \
    --warmup 8 --repeat-batch --no-roofline "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/$name.log | cut -c1-24 | tr '\n' ';'; echo
}
run r_1gpu_kw 115 0 mesh.data=1 stream.keep_weights=on
run r_1gpu 115 0 mesh.data=1
for n in r_1gpu_kw r_1gpu; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','timed_steps_falling')})" 2>&1 | tail -1; done
