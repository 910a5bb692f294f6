#!/usr/bin/env bash
# Next session, H200 (~540 s, timeout_s 600, carry build/calls). Issue 16's 7b at <= 20 GiB:
# - the machine's host memory first (its AdamW kernel and read/copy/triad rates: the lent
#   hosts differ by up to 15% and the 7b step follows them);
# - kept weights for the last 3 layers against none, in turns in one process (ab_step arms'
#   KEPT; about 2.3 GiB more): in the timelines of calls AE and G the backward's first fetch,
#   of the forward's last layer, took 85-100 ms while the update lane waited for the first
#   gradient;
# - PyTorch resident, then bench_step with none and with 3 kept (the headline rows).
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
timeout 60 python3 benchmarks/bench_host_update.py --repeats 3 --out $OUT/n_host.json \
  > $OUT/logs/n_host.log 2>&1; echo "host: rc $? ($SECONDS s)"; tail -12 $OUT/logs/n_host.log
timeout 170 python3 benchmarks/ab_step.py 7b --arm k0=auto:1:0 --arm k3=auto:1:3 --rounds 3 \
  --steps 3 --warmup 8 --repeat-batch stream.keep_weights=off --out $OUT/n_ab.json \
  > $OUT/logs/n_ab.log 2>&1; echo "ab: rc $? ($SECONDS s)"; tail -3 $OUT/logs/n_ab.log
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/n_peer.json > $OUT/logs/n_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run() {  # name, timeout, overrides (the last keep_weights wins)...
  local name=$1 t=$2; shift 2
  timeout $t python3 benchmarks/bench_step.py 7b --steps 6 --warmup 8 --repeat-batch \
    --no-roofline stream.keep_weights=off "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run n_e 125
run n_k3 125 stream.keep_weights=3
for n in n_peer n_e n_k3; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','speculated_parts','host_memory_gbps','layers_keeping_weights')})" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
