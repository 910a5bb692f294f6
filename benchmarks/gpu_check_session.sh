#!/usr/bin/env bash
# The H200 check of 2026-11-21 (session 2): 3b and 7b step benchmarks with the FSDP2 peer
# (gpu_session.sh), then a 1b CLI run with checkpoints, a resume and a report. Everything
# lands in $OUT/all.tgz (the device tool returns at most 8 files).
set -u
export OUT_FINAL=$OUT
export OUT=/tmp/o; mkdir -p $OUT
WORK=/tmp/o/steps RUNS="3b:--steps 6 --warmup 2 --phases 1|7b:--steps 6 --warmup 2 --repeat-batch --phases 1" PEERS="3b" bash benchmarks/gpu_session.sh 2>&1 | tail -12
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
R=/tmp/o/run1b
timeout 150 python3 -m megatrain_jax.cli train 1b loop.steps=4 loop.checkpoint_every=2 loop.log_every=1 loop.run_dir=$R > /tmp/o/run1b_a.log 2>&1; echo "first rc=$?"
timeout 150 python3 -m megatrain_jax.cli train 1b loop.steps=6 loop.checkpoint_every=2 loop.log_every=1 loop.run_dir=$R > /tmp/o/run1b_b.log 2>&1; echo "resume rc=$?"
tail -2 /tmp/o/run1b_b.log; cut -c1-120 $R/metrics.jsonl; ls $R/checkpoints
python3 -c "import matplotlib" 2>/dev/null && python3 -m megatrain_jax.cli report $R | head -8
cd /tmp && tar czf $OUT_FINAL/all.tgz --exclude='checkpoints' --exclude='o/all.tgz' o
