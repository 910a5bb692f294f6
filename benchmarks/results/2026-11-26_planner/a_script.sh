#!/usr/bin/env bash
# H200 (needs_h200: the hand placement holds 130 GiB of GPU): the planner's defaults at 7b
# against the best hand placement and PyTorch resident, repeated batch and fresh data.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/logs/gpu.txt; cat $OUT/logs/gpu.txt
free -g | head -2
timeout 60 python3 -m megatrain_jax.cli plan 7b > $OUT/logs/plan_7b.txt 2>&1; sed -n '/^placement/,/^compute-bound/p' $OUT/logs/plan_7b.txt
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run a_7b 170 7b 4 8 --repeat-batch
run a_hand 170 7b 4 8 --repeat-batch stream.resident_layers=32 stream.keep_layers=32
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/a_peer.json > $OUT/logs/a_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run a_clip 150 7b 4 4 data.source=random
for n in a_7b a_hand a_peer a_clip; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('device','tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','placement','predicted')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
