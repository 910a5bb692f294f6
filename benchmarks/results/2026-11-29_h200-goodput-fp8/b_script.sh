# FP8 projections end to end against bf16 (the defaults: the planner's placement, fresh data
# every step, so every step clips) and PyTorch with the whole model on the GPU and each
# decoder layer compiled, in one call on one H200.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B="--steps 4 --warmup 4 --no-roofline"
step() {  # name config overrides...
  name=$1; shift
  python benchmarks/bench_step.py "$@" $B --out $OUT/$name.json > $OUT/$name.log 2>&1 \
    || { echo "$name failed: $(tail -2 $OUT/$name.log)"; \
         python benchmarks/bench_step.py "$@" stream.gpu_budget_gb=120 $B --out $OUT/${name}_120.json \
           > $OUT/${name}_120.log 2>&1; }
}
step 7b_bf16 7b
step 7b_fp8 7b model.fp8_matmuls=true
step 3b_bf16 3b
step 3b_fp8 3b model.fp8_matmuls=true
cd benchmarks/peers
python torch_resident.py 7b --steps 4 --warmup 3 --compile --out $OUT/7b_peer.json > $OUT/7b_peer.log 2>&1
python torch_resident.py 3b --steps 4 --warmup 3 --compile --out $OUT/3b_peer.json > $OUT/3b_peer.log 2>&1
cd $OUT && tar czf logs.tgz *.log && python - <<'PY'
import json, glob
for f in sorted(glob.glob("*.json")):
    d = json.load(open(f))
    p = d.get("placement") or {}
    print(f"{f:18s} {d.get('tokens_per_s', 0):9,.0f} tok/s  GPU {d.get('peak_device_gib') or 0:6.1f} GiB"
          f"  host {d.get('peak_host_rss_gib') or 0:5.1f} GiB  R{p.get('resident_layers','-')} S{p.get('saving_layers','-')}"
          f"  E{int(bool(p.get('resident_embeddings')))}  last loss {(d.get('losses') or [0])[-1]:.4f}")
PY
