#!/usr/bin/env bash
# H200 (needs_h200: the 7b placement holds 126 GiB of GPU): the final planner's 7b defaults
# with PyTorch resident beside them, the 24 GiB budget once more, and 1b trained with every
# layer on the GPU with and without a checkpoint every 2 steps: the host's peak memory, to
# show that a save copies the GPU's state to the host an array at a time.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
run n_7b 90 7b 4 6 --repeat-batch
timeout 60 python3 benchmarks/peers/torch_resident.py 7b --steps 6 --warmup 2 \
  --out $OUT/n_peer.json > $OUT/logs/n_peer.log 2>&1; echo "peer: rc $? ($SECONDS s)"
run n_b24 100 7b 5 5 --repeat-batch stream.gpu_budget_gb=24
for every in 0 2; do
  timeout 100 python3 -m megatrain_jax.cli train 1b data.source=random data.batch_size=16 \
    data.seq_len=1024 loop.steps=8 loop.checkpoint_every=$every loop.keep_checkpoints=1 \
    loop.log_every=1 loop.progress=none loop.tensorboard=off loop.run_dir=/tmp/ck$every \
    > $OUT/logs/ck$every.log 2>&1; echo "checkpoint_every=$every: rc $? ($SECONDS s)"
  head -1 $OUT/logs/ck$every.log | cut -c1-200; cp /tmp/ck$every/metrics.jsonl $OUT/n_ck$every.jsonl
  python3 -c "import json; r=[json.loads(l) for l in open('/tmp/ck$every/metrics.jsonl')]; print('ck$every host peak GiB', round(max(x['host_rss_bytes'] for x in r)/2**30, 2), 'GPU peak', round(max(x['peak_device_bytes'] for x in r)/2**30, 1), 'steps s', [round(x['step_seconds'], 2) for x in r])"
  ls /tmp/ck$every/checkpoints 2>/dev/null
done
for n in n_7b n_peer n_b24; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; q=d.get('predicted') or {}; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), round(d['peak_host_rss_gib'],1), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','host_inputs')], round(q.get('expected_tokens_per_s_guessing', 0)), d.get('host_memory_gbps'))" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
