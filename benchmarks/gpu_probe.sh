#!/usr/bin/env bash
# Session 4, first H200 call: where the overlapped step loses time. (1) the host AdamW's
# rate alone, beside the weight stream and beside a busy core, per schedule, and the host
# memory's bandwidth (bench_host_update.py); (2) one timeline of an unsynced 7b and 3b step
# beside the usual step benchmark. Everything in $OUT/all.tgz, the short table last.
set -u
OUT_FINAL=${OUT:-/tmp/out}
W=/tmp/probe; mkdir -p $W
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{
nproc; grep -m1 "model name" /proc/cpuinfo; grep MemTotal /proc/meminfo
timeout 240 python3 benchmarks/bench_host_update.py --out $W/host_update.json 2> $W/host_update.err \
  > /dev/null || { echo FAILED host update; tail -20 $W/host_update.err; }
grep -v '^W' $W/host_update.err | tail -17
for shape in 7b 3b; do
  echo "== $shape"
  timeout 300 python3 benchmarks/bench_step.py $shape --steps 4 --warmup 2 --phases 1 \
    --timeline $W/timeline_$shape.json --out $W/step_$shape.json > $W/step_$shape.log 2>&1 \
    || { echo FAILED; grep -v '^W' $W/step_$shape.log | tail -20; }
  python3 benchmarks/timeline_summary.py $W/timeline_$shape.json $W/step_$shape.json
done
} 2>&1 | grep -v '^W' | tee $W/summary.txt
cd /tmp && tar czf "$OUT_FINAL/all.tgz" probe
