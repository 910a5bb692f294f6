# 7b at 524,288 tokens with recomputed inputs: four layers of the full plan's shape timed
# against the plan; then FP8's quality on fresh text: 1b, 300 steps of the Python standard
# library's source as bytes (no batch seen twice), bf16 and FP8 from the same start. One H200.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHONPATH=. timeout 330 python benchmarks/long_recompute.py --layers 4 --warmup 1 --steps 1 \
  --budget-s 270 --out $OUT/long_recompute.json > $OUT/long_recompute.log 2>&1
echo "long_recompute rc $?"; tail -12 $OUT/long_recompute.log
lib=$(python -c "import os, json; print(os.path.dirname(os.path.dirname(json.__file__)))")
python -m megatrain_jax.cli prepare "$lib/*.py" "$lib/*/*.py" --tokenizer bytes \
  --out /tmp/pydata --progress none > $OUT/prepare.log 2>&1; tail -2 $OUT/prepare.log
timeout 240 python benchmarks/quality.py 1b --compare model.fp8_matmuls=false,true \
  --name fp8_1b_code --out $OUT data.source=/tmp/pydata data.val_fraction=0.02 \
  loop.eval_every=50 loop.steps=300 optim.lr=3e-4 schedule.warmup_steps=30 \
  > $OUT/quality.log 2>&1; echo "quality rc $?"; tail -5 $OUT/quality.log
rm -rf $OUT/runs; cd $OUT && tar czf c_logs.tgz *.log && rm -f *.log && ls
