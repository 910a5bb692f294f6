#!/usr/bin/env bash
# H200 (~150 s, carry build/calls): the 7b headline's ratio with the backward's host memory
# measured beside both transfers (weights in, gradients out), as its step shares it.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
timeout 240 python3 benchmarks/bench_step.py 7b --steps 4 --warmup 8 --repeat-batch --phases 2 \
  stream.keep_weights=3 --out $OUT/p_ratio.json > $OUT/logs/p_ratio.log 2>&1
echo "ratio: rc $? ($SECONDS s)"; grep -E "^step" $OUT/logs/p_ratio.log | cut -c1-22 | tr '\n' ';'; echo
python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/p_ratio.json')); print({k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k in ('device','tokens_per_s','median_step_s','peak_device_gib','speculated_parts')}); r=d.get('roofline') or {}; print({k: (round(v,3) if isinstance(v,float) else v) for k,v in r.items() if not isinstance(v,(dict,list))})"
tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs
