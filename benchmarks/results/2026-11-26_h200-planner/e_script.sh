#!/usr/bin/env bash
# H200: 7b at a 24 GiB GPU budget (16x1024), the planner's placement with 3 GiB of headroom.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
timeout 200 python3 benchmarks/bench_step.py 7b --steps 4 --warmup 5 --no-roofline --repeat-batch \
  stream.gpu_budget_gb=24 --out $OUT/e_b24.json > $OUT/logs/e_b24.log 2>&1; echo "e_b24: rc $? ($SECONDS s)"
grep -E "^step" $OUT/logs/e_b24.log | cut -c1-60
python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/e_b24.json')); p=d.get('placement') or {}; q=d['predicted']; print('e_b24', round(d['tokens_per_s']), round(d['peak_device_gib'],2), round(d['peak_host_rss_gib'],1), p, round(q['expected_tokens_per_s_guessing']), d['guessing'])"
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
