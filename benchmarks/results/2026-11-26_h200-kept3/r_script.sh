#!/usr/bin/env bash
# H200 (needs_h200: the PyTorch peer holds 105 GiB), one call (~450 s, timeout_s 600, carry
# .whl build/calls): every issue-16 figure in one call, the 7b with its ratio to the bound.
# 7b 16x1024 with the last 3 layers keeping their weights; PyTorch resident; 3b by the
# defaults; DeepSpeed ZeRO-3 offload at 3b (at 7b it holds 154 GiB of host: not here);
# 7b at 64x1024 K=21.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > $OUT/logs/pip.log 2>&1 || { echo "pip failed"; tail -5 $OUT/logs/pip.log; }
run() {  # name, timeout, config, steps, warmup, overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --repeat-batch \
    --no-roofline "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
timeout 200 python3 benchmarks/bench_step.py 7b --steps 4 --warmup 8 --repeat-batch --phases 2 stream.keep_weights=3 --out $OUT/r_7b.json > $OUT/logs/r_7b.log 2>&1; echo "r_7b: rc $? ($SECONDS s)"
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/r_peer.json > $OUT/logs/r_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run r_3b 80 3b 6 8
PYTHONPATH=/tmp/site:$PYTHONPATH timeout 130 python3 benchmarks/peers/deepspeed_offload.py 3b \
  --steps 6 --warmup 2 --out $OUT/r_ds3b.json > $OUT/logs/r_ds3b.log 2>&1
echo "deepspeed 3b: rc $? ($SECONDS s)"
run r_k21 140 7b 3 8 data.batch_size=64 data.micro_batches=4 stream.keep_layers=21
for n in r_7b r_peer r_3b r_ds3b r_k21; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('device','tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','layers_keeping_weights','host_memory_gbps')})" 2>&1 | tail -1; done
python3 -c "import json,os; r=json.load(open(os.environ['OUT']+'/r_7b.json'))['roofline']; print({k: (round(v,3) if isinstance(v,float) else v) for k,v in r.items() if k in ('update_loss_h2d','update_loss_d2h','step_s','ratio','limited_by','compute_backward_s','host_memory_backward_s','update_backward_s')})"
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
