#!/usr/bin/env bash
# Issue 21, call P2 (tree: main cf00efb + kept-weights 72674e0), one call: 7b at 16x1024 per
# GPU on 1 GPU (default), 2 and 4 GPUs (stream.keep_weights=on), 6 timed steps after 8; then
# PyTorch FSDP2 + CPU offload on 4 ranks. Carry build/calls; about 480 s (timeout_s 590).
export PYTHONUNBUFFERED=1
run() {  # name, timeout, devices, overrides...
  local name=$1 t=$2 dev=$3; shift 3
  CUDA_VISIBLE_DEVICES=$dev timeout $t python3 benchmarks/bench_step.py 7b --steps 6 \
    --warmup 8 --repeat-batch --no-roofline "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/$name.log | cut -c1-24 | tr '\n' ';'; echo
}
run q_1gpu 150 0 mesh.data=1
run q_2gpu 115 0,1 mesh.data=2 data.batch_size=32 stream.keep_weights=on
run q_4gpu 115 0,1,2,3 mesh.data=4 data.batch_size=64 stream.keep_weights=on
CUDA_VISIBLE_DEVICES=0,1,2,3 timeout 150 python3 -m torch.distributed.run \
  --standalone --nproc_per_node=4 benchmarks/peers/fsdp2_offload.py 7b --steps 3 --warmup 1 \
  --out $OUT/q_peer_fsdp2_7b_4gpu.json > $OUT/q_peer_fsdp2_7b_4gpu.log 2>&1
echo "fsdp2 4 ranks: rc $? ($SECONDS s)"; tail -2 $OUT/q_peer_fsdp2_7b_4gpu.log | cut -c1-250
for n in q_1gpu q_2gpu q_4gpu q_peer_fsdp2_7b_4gpu; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','peak_host_rss_gib','timed_steps_falling')})" 2>&1 | tail -1; done
