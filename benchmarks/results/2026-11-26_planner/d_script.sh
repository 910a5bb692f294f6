#!/usr/bin/env bash
# H200 (needs_h200: the whole-GPU placement holds 120 GiB): the GPU budget sweep at 7b
# 16x1024 (24, 48, 80 GiB and the whole GPU) against plan's expectation, and 7b at 1x131072.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
timeout 60 python3 -m megatrain_jax.cli plan 7b --budgets 24,48,80 > $OUT/logs/d_plan.txt 2>&1; tail -6 $OUT/logs/d_plan.txt
for b in 24 48 80; do run d_b$b 85 7b 4 5 --repeat-batch stream.gpu_budget_gb=$b; done
run d_full 85 7b 4 5 --repeat-batch
run d_131k 230 7b 1 1 --repeat-batch data.batch_size=1 data.seq_len=131072 model.max_seq_len=131072
for n in d_b24 d_b48 d_b80 d_full d_131k; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; q=d['predicted']; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','attention_layers','weight_layers','host_inputs')], round(q['expected_tokens_per_s_guessing']), round(q['expected_tokens_per_s_clipping']), d['guessing'])" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
