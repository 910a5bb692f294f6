#!/usr/bin/env bash
# H200 (needs_h200: placements of 120-130 GiB of GPU): the planner's defaults at 7b 64x1024
# against the best hand placement, 7b at 1x131072, and a GPU budget sweep at 16x1024.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
B64="data.batch_size=64 data.micro_batches=4"
run c_64 130 7b 3 5 --repeat-batch $B64
run c_64_s21 130 7b 3 5 --repeat-batch $B64 stream.resident_layers=0 stream.keep_layers=21
run c_131k 200 7b 2 1 --repeat-batch data.batch_size=1 data.seq_len=131072 model.max_seq_len=131072
for b in 24 48 80; do run c_b$b 75 7b 4 5 --repeat-batch stream.gpu_budget_gb=$b; done
for n in c_64 c_64_s21 c_131k c_b24 c_b48 c_b80; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','attention_layers','weight_layers','host_inputs')], round(d['predicted']['tokens_per_s_guessing']), round(d['predicted']['tokens_per_s_clipping']))" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
