#!/usr/bin/env bash
# H200 (needs_h200: Muon's 7b and 14b placements hold 108-129 GiB of GPU): Muon
# (optim.name=muon, Newton-Schulz in bf16, the default) beside AdamW's defaults at 7b
# 16 x 1024 and 64 x 1024, and Muon at 14b, the largest shipped shape it fits at fp32 here.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
run l_muon 90 7b 4 4 --repeat-batch optim.name=muon
run l_adamw 80 7b 4 5 --repeat-batch
run l_muon64 120 7b 2 3 --repeat-batch optim.name=muon data.batch_size=64 data.micro_batches=4
run l_adamw64 110 7b 2 3 --repeat-batch data.batch_size=64 data.micro_batches=4
run l_muon14 130 14b 3 3 --repeat-batch optim.name=muon
for n in l_muon l_adamw l_muon64 l_adamw64 l_muon14; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; q=d.get('predicted') or {}; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), round(d['host_bytes_per_param'],2), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','attention_layers','weight_layers','host_inputs')], round(q.get('expected_tokens_per_s_guessing', 0)))" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
