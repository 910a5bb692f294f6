#!/usr/bin/env bash
# H200 call H1: is the host kernel of 339f9ba (one loop a leaf over 65,536-element tasks)
# slower on one GPU than 56e7b2a's (one loop a shard)? On the x4 host one GPU ran 1.84-1.88 s
# a step after it against 1.74 before (X4F). Then 7b on one GPU: kept weights auto (every
# layer), off, and the old tree; PyTorch resident. About 520 s.
export PYTHONUNBUFFERED=1
timeout 150 python3 build/calls/ab_kernel.py > $OUT/h1_ab_kernel.log 2>&1; echo "ab: rc $? ($SECONDS s)"
cat $OUT/h1_ab_kernel.log | tail -4
run() {  # name, timeout, tree, overrides...
  local name=$1 t=$2 tree=$3; shift 3
  timeout $t python3 $tree/benchmarks/bench_step.py 7b --steps 6 --warmup 8 --repeat-batch \
    --no-roofline "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run h1_auto 115 .
run h1_off 115 . stream.keep_weights=off
run h1_old 115 build/calls/old_tree
timeout 120 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/h1_peer_resident_7b.json > $OUT/h1_peer_resident_7b.log 2>&1
echo "resident: rc $? ($SECONDS s)"
for n in h1_auto h1_off h1_old h1_peer_resident_7b; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','timed_steps_falling')})" 2>&1 | tail -1; done
