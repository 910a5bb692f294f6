#!/usr/bin/env bash
# H200 (needs_h200: the PyTorch peer holds 105 GiB), second host, one call (~420 s, carry
# .whl build/calls): issue 16's 7b headline again (3 layers keeping their weights), PyTorch
# resident, DeepSpeed ZeRO-3 offload at 3b and ours at 3b, all in one call. (DeepSpeed at 7b
# holds 154 GiB of host: it cannot run on this 125 GiB host.)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > $OUT/logs/pip.log 2>&1 && export PYTHONPATH=/tmp/site:$PYTHONPATH \
  || { echo "pip failed"; tail -5 $OUT/logs/pip.log; }
run() {  # name, timeout, config, steps, warmup, overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --repeat-batch \
    --no-roofline "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run l_k3 120 7b 6 8 stream.keep_weights=3
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/l_peer.json > $OUT/logs/l_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run l_3b 80 3b 6 8
timeout 200 python3 benchmarks/peers/deepspeed_offload.py 3b --steps 6 --warmup 2 \
  --out $OUT/l_ds3b.json > $OUT/logs/l_ds3b.log 2>&1; echo "deepspeed 3b: rc $? ($SECONDS s)"
tail -3 $OUT/logs/l_ds3b.log
for n in l_k3 l_peer l_3b l_ds3b; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('device','tokens_per_s','tokens_per_s_guessing','median_step_s','peak_device_gib','peak_host_rss_gib','layers_keeping_weights','host_memory_gbps')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
