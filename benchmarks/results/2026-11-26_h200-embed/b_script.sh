#!/usr/bin/env bash
# Issue 16 headline on the H200, one call: 7b 16x1024 with kept weights off (the issue's
# <= 20 GiB; the embeddings on the GPU by auto) three times around PyTorch resident, then
# the defaults (kept weights auto too).
export PYTHONUNBUFFERED=1
run() {  # name, timeout, overrides...
  local name=$1 t=$2; shift 2
  timeout $t python3 benchmarks/bench_step.py 7b --steps 6 --warmup 8 --repeat-batch \
    --no-roofline "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run b_e1 120 stream.keep_weights=off
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/b_peer.json > $OUT/b_peer.log 2>&1; echo "resident: rc $? ($SECONDS s)"
run b_e2 120 stream.keep_weights=off
run b_def 120
run b_e3 120 stream.keep_weights=off
for n in b_e1 b_peer b_e2 b_def b_e3; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','layers_keeping_weights','resident_embeddings')})" 2>&1 | tail -1; done
