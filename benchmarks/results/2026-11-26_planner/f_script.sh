#!/usr/bin/env bash
# H200 (needs_h200: placements of 120-130 GiB of GPU, the peer 104 GiB): the planner's
# defaults with the final code: 7b with PyTorch resident in the same call, 3b beside its best
# hand placement found, 14b fp32 on the 125 GiB host, and 7b within a 24 GiB GPU budget.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
run f_7b 100 7b 4 6 --repeat-batch
timeout 80 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/f_peer.json > $OUT/logs/f_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run f_3b 75 3b 4 6 --repeat-batch
run f_3b_r21 75 3b 4 6 --repeat-batch stream.resident_layers=21 stream.keep_layers=26 stream.resident_embeddings=on
run f_14b 180 14b 3 4 --repeat-batch
run f_b24 130 7b 4 5 --repeat-batch stream.gpu_budget_gb=24
for n in f_7b f_peer f_3b f_3b_r21 f_14b f_b24; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; q=d.get('predicted') or {}; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','attention_layers','weight_layers','host_inputs')], round(q.get('expected_tokens_per_s_guessing', 0)), d.get('guessing'))" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
