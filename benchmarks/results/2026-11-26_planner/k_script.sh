#!/usr/bin/env bash
# Two GPUs of one host: 14b fp32 with the planner's defaults against every layer streamed
# (the earlier defaults' placement), 16x1024 tokens on each GPU, in one call.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,memory.total --format=csv | tail -2; free -g | sed -n 2p
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
run k_14b 200 14b 4 4 --repeat-batch data.batch_size=32
run k_14b_streamed 220 14b 4 4 --repeat-batch data.batch_size=32 stream.resident_layers=0 stream.keep_layers=0
for n in k_14b k_14b_streamed; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; print('$n', d['device'], d['devices'], round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','attention_layers','weight_layers','host_inputs')], d.get('guessing'))" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
