# The README's fine-tune recipe on a SmolLM2-135M-shaped model in bf16 and FP8
# (smol_finetune.sh: pretrain 300 steps here, export, fine-tune 200 steps from that folder);
# then 3b with FP8 projections (a saving layer keeping bf16 outputs) beside the compiled
# PyTorch peer. One H200.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
here=benchmarks/results/2026-11-29_h200-resolve
timeout 270 bash $here/smol_finetune.sh $OUT 300 200; echo "smol rc $?"
timeout 110 python benchmarks/bench_step.py 3b model.fp8_matmuls=true --steps 4 --warmup 4 \
  --no-roofline --out $OUT/3b_fp8.json > $OUT/3b_fp8.log 2>&1; echo "3b fp8 rc $?"
cd benchmarks/peers && timeout 120 python torch_resident.py 3b --steps 4 --warmup 3 --compile \
  --out $OUT/3b_peer.json > $OUT/3b_peer.log 2>&1; echo "3b peer rc $?"
cd $OUT && rm -rf runs && tar czf d_logs.tgz *.log && rm -f *.log && ls && python - <<'PY'
import json, glob
for f in sorted(glob.glob("3b_*.json")):
    d = json.load(open(f)); p = d.get("placement") or {}
    print(f, round(d.get("tokens_per_s", 0)), "GPU", round(d.get("peak_device_gib") or 0, 1), p)
PY
