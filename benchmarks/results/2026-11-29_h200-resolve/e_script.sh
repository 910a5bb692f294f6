# 7b with FP8 projections beside the compiled PyTorch peer, in one call. One H200.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 120 python benchmarks/bench_step.py 7b model.fp8_matmuls=true --steps 4 --warmup 4 \
  --no-roofline --out $OUT/7b_fp8.json > $OUT/7b_fp8.log 2>&1; echo "7b fp8 rc $?"
cd benchmarks/peers && timeout 140 python torch_resident.py 7b --steps 3 --warmup 2 --compile \
  --out $OUT/7b_peer.json > $OUT/7b_peer.log 2>&1; echo "7b peer rc $?"
cd $OUT && tar czf e_logs.tgz *.log && rm -f *.log && python - <<'PY'
import json, glob
for f in sorted(glob.glob("7b_*.json")):
    d = json.load(open(f)); p = d.get("placement") or {}
    print(f, round(d.get("tokens_per_s", 0)), "GPU", round(d.get("peak_device_gib") or 0, 1), p)
PY
