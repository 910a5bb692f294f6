#!/usr/bin/env bash
# 7b at <= 20 GiB (kept weights off, embeddings on the GPU by auto) with some layers' guesses
# computed on the GPU (stream.gpu_guesses), against none and PyTorch resident.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, overrides...
  local name=$1 t=$2; shift 2
  timeout $t python3 benchmarks/bench_step.py 7b --steps 6 --warmup 8 --repeat-batch \
    --no-roofline stream.keep_weights=off "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run h_g8 125 stream.gpu_guesses=8
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/h_peer.json > $OUT/logs/h_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run h_g0 125
run h_g4 125 stream.gpu_guesses=4
for n in h_g8 h_peer h_g0 h_g4; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','speculated_parts','rolled_back_parts')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
