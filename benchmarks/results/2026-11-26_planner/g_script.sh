#!/usr/bin/env bash
# H200 (needs_h200: placements of 125-130 GiB of GPU): the planner's defaults with the final
# code at 7b 64x1024 and 7b 1x131072.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
run g_64 150 7b 3 5 --repeat-batch data.batch_size=64 data.micro_batches=4
run g_131k 260 7b 1 1 --repeat-batch data.batch_size=1 data.seq_len=131072 model.max_seq_len=131072
for n in g_64 g_131k; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; q=d.get('predicted') or {}; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','attention_layers','weight_layers','host_inputs')], round(q.get('expected_tokens_per_s_guessing', 0)), d.get('guessing'))" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
