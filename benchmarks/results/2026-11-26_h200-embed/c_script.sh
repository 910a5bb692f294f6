#!/usr/bin/env bash
# H200: 3b 16x1024 by default (repeated batch); 7b at 64x1024 (4 micro-batches) with the
# saving layers K=21, K=18 and K=16 (auto: embeddings and kept weights where room is left).
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --repeat-batch \
    --no-roofline "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run c_3b 90 3b 6 8
big="data.batch_size=64 data.micro_batches=4"
run c_k21 115 7b 3 4 $big stream.keep_layers=21
run c_k18 115 7b 3 4 $big stream.keep_layers=18
run c_k16 115 7b 3 4 $big stream.keep_layers=16
for n in c_3b c_k21 c_k18 c_k16; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','layers_keeping_weights','resident_embeddings')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
