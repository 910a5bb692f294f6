#!/usr/bin/env bash
# Issue 16 on the H200, one call: 7b 16x1024, every layer streamed, kept weights off (GPU
# <= 20 GiB; the embeddings on the GPU by auto), three runs in turns with two of PyTorch
# resident.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, overrides...
  local name=$1 t=$2; shift 2
  timeout $t python3 benchmarks/bench_step.py 7b --steps 6 --warmup 8 --repeat-batch \
    --no-roofline "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
peer() {
  timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
    --out $OUT/$1.json > $OUT/logs/$1.log 2>&1; echo "$1: rc $? ($SECONDS s)"
}
peer d_peer1
run d_e1 115 stream.keep_weights=off
run d_e2 115 stream.keep_weights=off
peer d_peer2
run d_e3 115 stream.keep_weights=off
for n in d_peer1 d_e1 d_e2 d_peer2 d_e3; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','layers_keeping_weights','resident_embeddings')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
