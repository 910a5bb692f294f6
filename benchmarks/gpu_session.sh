#!/usr/bin/env bash
# One device call: transfer rates, then step benchmarks; a short table last. The JSON files
# and logs go to $WORK (default /tmp/gpu_session) and, packed, to $OUT/all.tgz with the table
# in $OUT/summary.txt: the device tool brings back only a few files.
# Usage (on the GPU machine, from the repo root):
#   bash benchmarks/gpu_session.sh ; env RUNS="..." to choose the runs, PEERS="3b" for peers.
set -uo pipefail
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
OUT=${WORK:-/tmp/gpu_session}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c 'import jax; print(jax.__version__, jax.devices())' >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 120 python3 benchmarks/bench_transfer.py --gib 4 --out "$OUT/transfer.json" > "$OUT/transfer.log" 2>&1 || tail -20 "$OUT/transfer.log"
RUNS=${RUNS:-"3b:--steps 4 --warmup 2 --phases 1|7b:--steps 8 --warmup 2 --repeat-batch --phases 1"}
IFS='|' read -ra items <<< "$RUNS"
for item in "${items[@]}"; do
  name=${item%%:*}; rest=${item#*:}
  tag=$(echo "$name $rest" | tr -c 'a-zA-Z0-9\n' '_' | cut -c1-150)
  echo "== $name $rest"
  # shellcheck disable=SC2086
  timeout ${RUN_TIMEOUT:-400} python3 benchmarks/bench_step.py $name $rest --out "$OUT/step_$tag.json" > "$OUT/step_$tag.log" 2>&1 \
    || { echo "FAILED: $name"; grep -v '^W' "$OUT/step_$tag.log" | tail -25; }
done
# Peers in the same call: PEERS="3b|..." shapes for PyTorch FSDP2 + CPUOffloadPolicy.
IFS='|' read -ra peers <<< "${PEERS:-}"
for shape in "${peers[@]}"; do
  echo "== peer fsdp2 $shape"
  timeout 400 python3 benchmarks/peers/fsdp2_offload.py $shape --out "$OUT/peer_fsdp2_$shape.json" > "$OUT/peer_fsdp2_$shape.log" 2>&1 \
    || { echo "FAILED: peer $shape"; grep -v '^W' "$OUT/peer_fsdp2_$shape.log" | tail -25; }
done
python3 benchmarks/summarize.py "$OUT" | tee "$OUT/summary.txt"
cp "$OUT/summary.txt" "$FINAL/summary.txt"
tar czf "$FINAL/all.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
