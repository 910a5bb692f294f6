#!/usr/bin/env bash
# H200: 1b wholly on the GPU with a checkpoint every 2 steps, once a save copies the GPU's
# state at once where the host has room (call o read it an array at a time).
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
for every in 2; do
  timeout 120 python3 -m megatrain_jax.cli train 1b data.source=random data.batch_size=16 \
    data.seq_len=1024 loop.steps=8 loop.checkpoint_every=$every loop.keep_checkpoints=1 \
    loop.log_every=1 loop.progress=none loop.tensorboard=off loop.run_dir=/tmp/ck$every \
    > $OUT/logs/ck$every.log 2>&1; echo "checkpoint_every=$every: rc $? ($SECONDS s)"
  head -1 $OUT/logs/ck$every.log | cut -c1-200; cp /tmp/ck$every/metrics.jsonl $OUT/p_ck$every.jsonl
  python3 -c "import json; r=[json.loads(l) for l in open('/tmp/ck$every/metrics.jsonl')]; print('ck$every host peak GiB', round(max(x['host_rss_bytes'] for x in r)/2**30, 2), 'GPU peak', round(max(x['peak_device_bytes'] for x in r)/2**30, 1), 'steps s', [round(x['step_seconds'], 2) for x in r], 'losses', [round(x['loss'], 4) for x in r][-2:])"
  ls /tmp/ck$every/checkpoints 2>/dev/null; tail -1 $OUT/logs/ck$every.log | cut -c1-300
done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
