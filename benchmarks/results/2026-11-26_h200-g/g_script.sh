#!/usr/bin/env bash
# Where the 7b step (kept weights off, embeddings on the GPU) goes now: one step's timeline;
# the step with 4 layers resident (a quarter less host update and weight stream: how much
# the host lane paces); the plain step and PyTorch resident beside them.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, steps, overrides...
  local name=$1 t=$2 s=$3; shift 3
  timeout $t python3 benchmarks/bench_step.py 7b --steps $s --warmup 8 --repeat-batch \
    --no-roofline stream.keep_weights=off "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run g_tl 125 3 --timeline $OUT/g_tl_timeline.json
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/g_peer.json > $OUT/logs/g_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run g_r4 125 6 stream.resident_layers=4
run g_e 125 6
python3 benchmarks/timeline_summary.py $OUT/g_tl_timeline.json $OUT/g_tl.json > $OUT/g_tl_summary.txt 2>&1
tail -30 $OUT/g_tl_summary.txt
for n in g_tl g_peer g_r4 g_e; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','speculated_parts')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
