#!/usr/bin/env bash
# H200 call H2: the old tree (56e7b2a, one loop a shard) and this one (kept weights off) in
# turns, 7b on one GPU: H1 had them 1.94 against 2.06 s a step, the kernel alone equal.
export PYTHONUNBUFFERED=1
run() {  # name, timeout, tree, overrides...
  local name=$1 t=$2 tree=$3; shift 3
  timeout $t python3 $tree/benchmarks/bench_step.py 7b --steps 6 --warmup 8 --repeat-batch \
    --no-roofline "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run h2_old1 105 build/calls/old_tree
run h2_off1 105 . stream.keep_weights=off
run h2_old2 105 build/calls/old_tree
run h2_off2 105 . stream.keep_weights=off
for n in h2_old1 h2_off1 h2_old2 h2_off2; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib')})" 2>&1 | tail -1; done
