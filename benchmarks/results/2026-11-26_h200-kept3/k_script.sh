#!/usr/bin/env bash
# H200 (needs_h200: the PyTorch peer holds 105 GiB), one call (~480 s, timeout_s 600, carry
# build/calls): issue 16's figures together, 7b with the last layers keeping their weights.
# 7b 16x1024 with 3 kept (call J on an H100: 9,127 against 8,916 with none, 15.4 GiB);
# PyTorch resident; 7b with 6 kept; 3b by the defaults; 7b at 64x1024 K=21.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --repeat-batch \
    --no-roofline "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run k_k3 120 7b 6 8 stream.keep_weights=3
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/k_peer.json > $OUT/logs/k_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run k_k6 120 7b 6 8 stream.keep_weights=6
run k_3b 80 3b 6 8
run k_k21 150 7b 3 8 data.batch_size=64 data.micro_batches=4 stream.keep_layers=21
for n in k_k3 k_peer k_k6 k_3b k_k21; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('device','tokens_per_s','tokens_per_s_guessing','median_step_s','peak_device_gib','peak_host_rss_gib','layers_keeping_weights','host_memory_gbps')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
