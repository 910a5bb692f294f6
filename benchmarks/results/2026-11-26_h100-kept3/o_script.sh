#!/usr/bin/env bash
# H200, one call (~230 s, carry build/calls): where the 7b headline step (3 layers keeping
# their weights) loses to its bound (1.729 s against 1.542 in call N): one step's timeline;
# then prefetch depth 3 against 2 in the same settings.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, steps, overrides...
  local name=$1 t=$2 s=$3; shift 3
  timeout $t python3 benchmarks/bench_step.py 7b --steps $s --warmup 8 --repeat-batch \
    --no-roofline stream.keep_weights=3 "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run o_tl 110 3 --timeline $OUT/o_tl_timeline.json
python3 benchmarks/timeline_summary.py $OUT/o_tl_timeline.json $OUT/o_tl.json > $OUT/o_tl_summary.txt 2>&1
tail -16 $OUT/o_tl_summary.txt
run o_p3 110 6 stream.prefetch_depth=3
for n in o_tl o_p3; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','speculated_parts','host_memory_gbps')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
