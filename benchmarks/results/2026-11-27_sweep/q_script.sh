#!/usr/bin/env bash
# H200 (needs_h200: the whole-GPU placement holds about 126 GiB): the GPU budget sweep of 7b at
# 16 x 1024 tokens on one machine, with `plan`'s expectations at the preset's rates and at the
# rates `plan --measure` takes on this machine; then the defaults on fresh data (every step
# clips) and PyTorch resident beside them.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
python3 -m megatrain_jax.cli plan 7b --budgets 24,48,80,132 > $OUT/logs/plan.txt 2>&1
grep -A6 "by GPU budget" $OUT/logs/plan.txt
run q_b24 100 7b 5 5 --repeat-batch stream.gpu_budget_gb=24
run q_b48 100 7b 5 5 --repeat-batch stream.gpu_budget_gb=48
run q_b80 90 7b 5 5 --repeat-batch stream.gpu_budget_gb=80
run q_7b 100 7b 4 6 --repeat-batch
run q_clip 90 7b 5 4 data.source=random
timeout 150 python3 -m megatrain_jax.cli plan 7b --measure --budgets 24,48,80,132 \
  > $OUT/logs/plan_measure.txt 2>&1; echo "plan --measure: rc $? ($SECONDS s)"
grep -A6 "by GPU budget" $OUT/logs/plan_measure.txt; grep -E "^rates" $OUT/logs/plan_measure.txt
for n in q_b24 q_b48 q_b80 q_7b q_clip; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; q=d.get('predicted') or {}; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','attention_layers','weight_layers','host_inputs')], round(q.get('expected_tokens_per_s_speculating', 0)), round(q.get('expected_tokens_per_s_clipping', 0)), d.get('host_memory_gbps'))" 2>&1 | tail -1; done
tar czf $OUT/q_logs.tgz -C $OUT logs && rm -r $OUT/logs
