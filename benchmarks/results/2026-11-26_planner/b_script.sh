#!/usr/bin/env bash
# H200 (needs_h200: placements of 120-135 GiB of GPU): the planner's defaults against hand
# placements at 7b, 3b and 14b fp32, 16x1024, repeated batch, one call.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
run b_7b 120 7b 4 6 --repeat-batch
run b_7b_r32s32 120 7b 4 6 --repeat-batch stream.gpu_budget_gb=139 stream.resident_layers=32 stream.keep_layers=32
run b_7b_r32s30 120 7b 4 6 --repeat-batch stream.resident_layers=32 stream.keep_layers=30
run b_3b 90 3b 4 6 --repeat-batch
run b_3b_hand 90 3b 4 6 --repeat-batch stream.resident_layers=26 stream.keep_layers=26
run b_14b 200 14b 3 4 --repeat-batch
run b_14b_r20 170 14b 3 4 --repeat-batch stream.resident_layers=20 stream.keep_layers=0
for n in b_7b b_7b_r32s32 b_7b_r32s30 b_3b b_3b_hand b_14b b_14b_r20; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','weight_layers','host_inputs')], round(d['predicted']['tokens_per_s_guessing']), round(d['predicted']['tokens_per_s_clipping']))" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
