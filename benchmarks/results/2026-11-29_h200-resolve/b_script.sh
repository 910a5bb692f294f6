# Saves and goodput with the staging area made before the first step (1b, 600 steps, every
# step recorded), then FP8's quality: 1b, 300 steps of the bundled English text, bf16 and FP8
# from the same start. One H200.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python benchmarks/bench_goodput.py --dir /tmp/runs --out $OUT/goodput.jsonl \
  saves200:1b,loop.steps=600,loop.checkpoint_every=200,loop.keep_checkpoints=1,loop.log_every=1 \
  nosaves:1b,loop.steps=600,loop.final_checkpoint=false,loop.stop_save=false,loop.log_every=1 \
  > $OUT/goodput.log 2>&1
cp /tmp/runs/saves200/metrics.jsonl $OUT/saves200_metrics.jsonl
cp /tmp/runs/nosaves/metrics.jsonl $OUT/nosaves_metrics.jsonl
tail -4 $OUT/goodput.log
python - <<'PY'
import json, os
for name in ("saves200", "nosaves"):
    s = [json.loads(l)["step_seconds"] for l in open(f"{os.environ['OUT']}/{name}_metrics.jsonl")]
    print(name, "steps 2-9 s:", round(sum(s[1:9]), 2), "mean by 100:",
          " ".join(f"{sum(s[i:i + 100]) / len(s[i:i + 100]):.4f}" for i in range(1, 600, 100)))
PY
rm -rf /tmp/runs
timeout 240 python benchmarks/quality.py 1b --compare model.fp8_matmuls=false,true --name fp8_1b \
  --out $OUT data.source=bundled data.val_fraction=0.05 loop.eval_every=50 loop.steps=300 \
  optim.lr=3e-4 schedule.warmup_steps=30 > $OUT/quality.log 2>&1; echo "quality rc $?"; tail -5 $OUT/quality.log
rm -rf $OUT/runs; cd $OUT && tar czf b_logs.tgz *.log && rm -f *.log && ls
