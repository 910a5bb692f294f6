# Saves and goodput again with the save's writer threads at a lower priority (nice 10), every
# step recorded; then 7b with FP8 projections, a saving layer keeping bf16 outputs. One H200.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python benchmarks/bench_step.py 7b model.fp8_matmuls=true --steps 4 --warmup 4 --no-roofline \
  --out $OUT/7b_fp8.json > $OUT/7b_fp8.log 2>&1 || tail -3 $OUT/7b_fp8.log
python benchmarks/bench_goodput.py --dir /tmp/runs --out $OUT/goodput.jsonl \
  saves200:1b,loop.steps=600,loop.checkpoint_every=200,loop.keep_checkpoints=1,loop.log_every=1 \
  nosaves:1b,loop.steps=600,loop.final_checkpoint=false,loop.stop_save=false,loop.log_every=1 \
  > $OUT/goodput.log 2>&1
cp /tmp/runs/saves200/metrics.jsonl $OUT/saves200_metrics.jsonl
cp /tmp/runs/nosaves/metrics.jsonl $OUT/nosaves_metrics.jsonl
tail -4 $OUT/goodput.log
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/7b_fp8.json"))
p = d["placement"]
print(f"7b fp8 {d['tokens_per_s']:,.0f} tok/s GPU {d['peak_device_gib']:.1f} GiB host {d['peak_host_rss_gib']:.1f} GiB R{p['resident_layers']} S{p['saving_layers']} E{int(p['resident_embeddings'])} losses {[round(x, 4) for x in d['losses']]}")
for name in ("saves200", "nosaves"):
    s = [json.loads(l)["step_seconds"] for l in open(f"{os.environ['OUT']}/{name}_metrics.jsonl")]
    w = [sum(s[i:i + 100]) / len(s[i:i + 100]) for i in range(1, 600, 100)]
    print(name, "mean step s by 100 steps:", " ".join(f"{x:.4f}" for x in w))
PY
