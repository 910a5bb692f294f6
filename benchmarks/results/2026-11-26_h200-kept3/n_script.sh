#!/usr/bin/env bash
# H200, one call (~300 s, carry build/calls): the 7b headline's ratio to the bound (3 layers
# keeping their weights; rates measured in the process, 2 synced steps), and the same
# settings on fresh random batches, whose steps all clip (the policy then never guesses).
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
timeout 240 python3 benchmarks/bench_step.py 7b --steps 4 --warmup 8 --repeat-batch --phases 2 \
  stream.keep_weights=3 --out $OUT/n_ratio.json > $OUT/logs/n_ratio.log 2>&1
echo "ratio: rc $? ($SECONDS s)"; grep -iE "^step|bound|ratio" $OUT/logs/n_ratio.log | cut -c1-120 | tail -12
timeout 120 python3 benchmarks/bench_step.py 7b --steps 6 --warmup 2 --no-roofline \
  stream.keep_weights=3 --out $OUT/n_clip.json > $OUT/logs/n_clip.log 2>&1
echo "clip: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/n_clip.log | cut -c1-22 | tr '\n' ';'; echo
for n in n_ratio n_clip; do python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/$n.json')); print('$n', {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('tokens_per_s','median_step_s','peak_device_gib','speculated_parts','rolled_back_parts','grad_norms','host_memory_gbps')}); r=d.get('roofline') or {}; print({k: (round(v,3) if isinstance(v,float) else v) for k,v in r.items() if not isinstance(v,(dict,list))})" 2>&1 | tail -2; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
