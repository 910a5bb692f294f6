#!/usr/bin/env bash
# Next session, H200, one call (~500 s, timeout_s 600, carry build/calls): issue 16's
# figures together. 7b at 64x1024 K=21 with steps that guess (the repeated batch clips for
# its first five steps: --warmup 8); PyTorch resident; 7b 16x1024 at <= 20 GiB (kept weights
# off, embeddings on the GPU by auto) twice; 3b by the defaults.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --repeat-batch \
    --no-roofline "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run f_e1 115 7b 6 8 stream.keep_weights=off
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/f_peer.json > $OUT/logs/f_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run f_e2 115 7b 6 8 stream.keep_weights=off
run f_3b 80 3b 6 8
run f_k21 150 7b 3 8 data.batch_size=64 data.micro_batches=4 stream.keep_layers=21
for n in f_e1 f_peer f_e2 f_3b f_k21; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','tokens_per_s_guessing','median_step_s','peak_device_gib','peak_host_rss_gib','layers_keeping_weights','resident_embeddings')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
