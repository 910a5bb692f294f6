#!/usr/bin/env bash
# H200 (needs_h200: placements of 120-130 GiB of GPU, the peer 104 GiB): the planner with the
# fitted expectation (bound x 1.045 + 0.18 x the host update) and deferred checkpoint copies:
# 7b defaults with PyTorch resident beside them, fresh data clipping every step, the budget
# sweep at 24/48/80 GiB, and the earlier default placement (R30 S32) by hand.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
run i_7b 100 7b 4 6 --repeat-batch
timeout 60 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/i_peer.json > $OUT/logs/i_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run i_clip 90 7b 5 4 data.source=random
run i_b24 100 7b 5 5 --repeat-batch stream.gpu_budget_gb=24
run i_b48 100 7b 5 5 --repeat-batch stream.gpu_budget_gb=48
run i_b80 90 7b 5 5 --repeat-batch stream.gpu_budget_gb=80
run i_hand 80 7b 4 6 --repeat-batch stream.resident_layers=30 stream.keep_layers=32 stream.resident_embeddings=off
for n in i_7b i_peer i_clip i_b24 i_b48 i_b80 i_hand; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; q=d.get('predicted') or {}; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','attention_layers','weight_layers','host_inputs')], round(q.get('expected_tokens_per_s_guessing', 0)), round(q.get('expected_tokens_per_s_clipping', 0)), d.get('host_memory_gbps'))" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
