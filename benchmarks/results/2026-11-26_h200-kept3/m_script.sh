#!/usr/bin/env bash
# H200 (needs_h200: the PyTorch peer holds 105 GiB), one call (~480 s, timeout_s 600, carry
# .whl build/calls): every issue-16 figure in one call, on another machine than K and L.
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
run m_k3 110 7b 6 8 stream.keep_weights=3
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/m_peer.json > $OUT/logs/m_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run m_3b 80 3b 6 8
PYTHONPATH=/tmp/site:$PYTHONPATH timeout 130 python3 benchmarks/peers/deepspeed_offload.py 3b \
  --steps 6 --warmup 2 --out $OUT/m_ds3b.json > $OUT/logs/m_ds3b.log 2>&1
echo "deepspeed 3b: rc $? ($SECONDS s)"
run m_k21 140 7b 3 8 data.batch_size=64 data.micro_batches=4 stream.keep_layers=21
for n in m_k3 m_peer m_3b m_ds3b m_k21; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('device','tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','layers_keeping_weights','host_memory_gbps')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
