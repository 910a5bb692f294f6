# The planner against the H200 (defaults of 7b, 3b, 14b; peak RSS against the planner's host
# total), the first GPU run of the moments in plain host memory; and the GEMM-fallback test of
# the small HF fine-tune through the command line on the GPU. One H200.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 120 python -m pytest tests/test_gemm_fallback.py -q -rs -p no:cacheprovider \
  > $OUT/gemm_test.log 2>&1; echo "gemm test rc $?"; tail -3 $OUT/gemm_test.log
PYTHONPATH=. timeout 450 python benchmarks/plan_check.py > $OUT/plan_check.log 2>&1
echo "plan_check rc $?"
cd $OUT && tar czf a_logs.tgz *.log *b.json && tail -12 plan_check.log && rm -f *.log *b.json
