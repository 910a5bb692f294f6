# Saves and goodput on the final code (the staging area reserved on a background thread),
# the GEMM-fallback GPU test, and FP8 against bf16 per layer. One H200.
cd "$(dirname "$0")/../../.." 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m pytest -q tests/test_gemm_fallback.py > $OUT/gemm_test.log 2>&1; tail -3 $OUT/gemm_test.log
python benchmarks/bench_fp8.py --configs 3b,7b --repeats 10 > $OUT/fp8.log 2>&1; tail -7 $OUT/fp8.log
python benchmarks/bench_goodput.py --dir /tmp/runs --out $OUT/goodput.jsonl \
  nosaves:1b,loop.steps=600,loop.final_checkpoint=false,loop.stop_save=false \
  saves200:1b,loop.steps=600,loop.checkpoint_every=200,loop.keep_checkpoints=1 \
  every5:1b,loop.steps=15,loop.checkpoint_every=5,loop.keep_checkpoints=1 > $OUT/goodput.log 2>&1
tail -8 $OUT/goodput.log
