#!/usr/bin/env bash
# H200: `plan --measure` on this machine and its expected tokens/s by GPU budget, with the
# 24 and 48 GiB budgets measured on the same machine; and loss curves of Muon and AdamW,
# 1b from scratch, 200 steps of 16 x 1024 tokens of a prepared text (the Python standard
# library's modules, byte tokens), a fresh batch every step.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
run() {  # name, timeout, config, steps, warmup, flags and overrides...
  local name=$1 t=$2 c=$3 s=$4 w=$5; shift 5
  timeout $t python3 benchmarks/bench_step.py $c --steps $s --warmup $w --no-roofline "$@" \
    --out $OUT/$name.json > $OUT/logs/$name.log 2>&1
  echo "$name: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/$name.log | cut -c1-22 | tr '\n' ';'; echo
  grep -E "Error|error" $OUT/logs/$name.log | tail -2
}
timeout 150 python3 -m megatrain_jax.cli plan 7b --measure --budgets 24,48,80,132 \
  > $OUT/m_plan_measure.txt 2>&1; echo "plan: rc $? ($SECONDS s)"
grep -A6 "by GPU budget" $OUT/m_plan_measure.txt; grep -E "^rates|^expected" $OUT/m_plan_measure.txt
STD=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
python3 -m megatrain_jax.cli prepare "$STD/*.py" --out /tmp/pytext --tokenizer bytes \
  --progress none > $OUT/logs/prepare.log 2>&1; echo "prepare: rc $? ($SECONDS s)"
curve() {  # name, overrides...
  local name=$1; shift
  timeout 170 python3 -m megatrain_jax.cli train 1b data.source=/tmp/pytext data.batch_size=16 \
    data.seq_len=1024 loop.steps=200 schedule.kind=cosine schedule.warmup_steps=20 \
    loop.log_every=1 loop.progress=plain loop.tensorboard=off loop.run_dir=/tmp/$name "$@" \
    > $OUT/logs/$name.log 2>&1; echo "$name: rc $? ($SECONDS s)"
  cp /tmp/$name/metrics.jsonl $OUT/m_$name.jsonl; tail -2 $OUT/logs/$name.log | cut -c1-200
}
curve adamw1b optim.lr=3e-4
curve muon1b optim.name=muon optim.lr=0.01
run m_b24 100 7b 5 5 --repeat-batch stream.gpu_budget_gb=24
run m_b48 100 7b 5 5 --repeat-batch stream.gpu_budget_gb=48
for n in m_b24 m_b48; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); p=d.get('placement') or {}; q=d.get('predicted') or {}; print('$n', round(d['tokens_per_s']), round(d['peak_device_gib'],1), [p.get(k) for k in ('resident_layers','resident_embeddings','saving_layers','host_inputs')], round(q.get('expected_tokens_per_s_guessing', 0)), d.get('host_memory_gbps'))" 2>&1 | tail -1; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
