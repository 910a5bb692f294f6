#!/usr/bin/env bash
# H200 (needs_h200: the PyTorch peer holds 105 GiB), one call (~300 s, carry build/calls):
# the 7b headline (3 layers keeping their weights) with its ratio to the bound, the host
# update's losses beside each transfer measured (8907034); PyTorch resident; 3b with its ratio.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, overrides...
  local name=$1 t=$2 c=$3; shift 3
  timeout $t python3 benchmarks/bench_step.py $c --steps 4 --warmup 8 --repeat-batch --phases 2 \
    "$@" --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
}
run q_7b 200 7b stream.keep_weights=3
timeout 75 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/q_peer.json > $OUT/logs/q_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run q_3b 150 3b
for n in q_7b q_peer q_3b; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('device','tokens_per_s','median_step_s','peak_device_gib','speculated_parts')}); r=d.get('roofline') or {}; print({k: (round(v,3) if isinstance(v,float) else v) for k,v in r.items() if k in ('host_memory_kernel_gbps','host_memory_shared_gbps','host_memory_left_by_h2d_gbps','host_memory_left_by_d2h_gbps','update_loss_h2d','update_loss_d2h','optimizer_s','update_forward_s','update_backward_s','host_memory_forward_s','host_memory_backward_s','compute_backward_s','h2d_per_pass_s','step_s','ratio','limited_by')})" 2>&1 | tail -2; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
