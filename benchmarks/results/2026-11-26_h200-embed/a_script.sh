#!/usr/bin/env bash
# Resident embeddings A/B on the H200: 7b 16x1024, kept weights off (the issue's <= 20 GiB),
# embeddings streamed / resident / PyTorch resident / resident / streamed.
export PYTHONUNBUFFERED=1
run() {  # name, timeout, overrides...
  local name=$1 t=$2; shift 2
  timeout $t python3 benchmarks/bench_step.py 7b --steps 6 --warmup 8 --repeat-batch \
    --no-roofline stream.keep_weights=off "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run a_off 110 stream.resident_embeddings=off
run a_on 110 stream.resident_embeddings=on
timeout 70 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/a_peer_resident_7b.json > $OUT/a_peer_resident_7b.log 2>&1; echo "resident: rc $? ($SECONDS s)"
run a_on2 110 stream.resident_embeddings=on
run a_off2 110 stream.resident_embeddings=off
for n in a_off a_on a_peer_resident_7b a_on2 a_off2; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','layers_keeping_weights')})" 2>&1 | tail -1; done
