#!/usr/bin/env bash
# One device call: transfer rates, then step benchmarks; full JSON and logs under $OUT,
# a short table last. Usage (on the GPU machine, from the repo root):
#   bash benchmarks/gpu_session.sh [3b-args] ; env RUNS="..." to choose the runs.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c 'import jax; print(jax.__version__, jax.devices())' >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 120 python3 benchmarks/bench_transfer.py --gib 4 --out "$OUT/transfer.json" > "$OUT/transfer.log" 2>&1 || tail -20 "$OUT/transfer.log"
RUNS=${RUNS:-"3b:--steps 4 --warmup 2 --phases 1|7b:--steps 8 --warmup 2 --repeat-batch --phases 1"}
IFS='|' read -ra items <<< "$RUNS"
for item in "${items[@]}"; do
  name=${item%%:*}; rest=${item#*:}
  tag=$(echo "$name $rest" | tr -c 'a-zA-Z0-9\n' '_' | cut -c1-70)
  echo "== $name $rest"
  # shellcheck disable=SC2086
  timeout 400 python3 benchmarks/bench_step.py $name $rest --out "$OUT/step_$tag.json" > "$OUT/step_$tag.log" 2>&1 \
    || { echo "FAILED: $name"; grep -v '^W' "$OUT/step_$tag.log" | tail -25; }
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
t = out / "transfer.json"
if t.exists():
    r = json.loads(t.read_text())
    print(f"transfer: H2D {r['h2d_gbps']:.1f} GB/s  D2H {r['d2h_gbps']:.1f}  both {r['bidirectional_total_gbps']:.1f}  update {r['update_gparams_per_s']:.2f} Gparam/s")
print(f"{'run':28s} {'tok/s':>8s} {'step s':>7s} {'TFLOP/s':>8s} {'MFU':>6s} {'GPU GiB':>8s} {'host B/p':>8s}  losses / phases")
for f in sorted(out.glob("step_*.json")):
    r = json.loads(f.read_text())
    ph = r["phase_seconds_synced"][-1] if r["phase_seconds_synced"] else {}
    print(f"{f.stem[5:33]:28s} {r['tokens_per_s']:8.0f} {r['median_step_s']:7.3f} {r['model_tflops']:8.1f} "
          f"{(r['mfu'] or 0):6.3f} {r['peak_device_gib']:8.2f} {r['host_bytes_per_param']:8.1f}  "
          f"{r['losses'][0]:.3f}->{r['losses'][-1]:.3f} {r['host_state_memory_kinds']} "
          + " ".join(f"{k}={v:.2f}" for k, v in ph.items()))
PY
