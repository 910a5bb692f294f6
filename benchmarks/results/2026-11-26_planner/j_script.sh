#!/usr/bin/env bash
# H200 (needs_h200: placements of 120-130 GiB): `plan --measure` on this machine and its
# expected tokens/s at each GPU budget, then the sweep measured on the same machine; AdamW's
# 7b defaults beside Muon's (optim.name=muon, fp32 Newton-Schulz) at 16 x 1024.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
timeout 150 python3 -m megatrain_jax.cli plan 7b --measure --budgets 24,48,80,132 \
  > $OUT/j_plan_measure.txt 2>&1; echo "plan: rc $? ($SECONDS s)"
grep -A6 "by GPU budget" $OUT/j_plan_measure.txt; grep -E "^rates|^expected" $OUT/j_plan_measure.txt
run j_b24 100 7b 5 5 --repeat-batch stream.gpu_budget_gb=24
run j_b48 100 7b 5 5 --repeat-batch stream.gpu_budget_gb=48
run j_b80 90 7b 5 5 --repeat-batch stream.gpu_budget_gb=80
run j_muon 120 7b 4 4 --repeat-batch optim.name=muon
run j_7b 90 7b 4 6 --repeat-batch
for n in j_b24 j_b48 j_b80 j_muon j_7b; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; q=d.get('predicted') or {}; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), round(d['host_bytes_per_param'],2), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','attention_layers','weight_layers','host_inputs')], round(q.get('expected_tokens_per_s_guessing', 0)), d.get('host_memory_gbps'))" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
