#!/usr/bin/env bash
# The H200 check of real use (session 3): the planner measured on the machine, then a 0.9B
# Llama made by transformers is imported, fine-tuned on packed instruction data with a
# validation split and checkpoints, exported, and loaded back by transformers.
# Everything lands in $OUT/all.tgz (the device tool returns at most 8 files).
set -u
OUT_FINAL=${OUT:-/tmp/out}
W=/tmp/w; mkdir -p $W
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
CLI="python3 -m megatrain_jax.cli"
{
grep -E 'MemTotal|MemAvailable' /proc/meminfo
echo "== plan 7b, measured"
timeout 240 $CLI plan 7b data.batch_size=16 data.seq_len=1024 --measure 2>&1 | grep -v '^W'

echo "== a 0.9B Llama from transformers (bf16, sharded)"
timeout 200 python3 - <<'EOF'
import json, random, torch, transformers as T
torch.manual_seed(0)
cfg = T.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                    num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                    max_position_embeddings=2048, rope_theta=10000.0, torch_dtype="bfloat16")
model = T.LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained("/tmp/w/hf_src", max_shard_size="1GB")
random.seed(0)
with open("/tmp/w/pairs.jsonl", "w") as f:
    for i in range(3000):
        a, b = random.randint(0, 999), random.randint(0, 999)
        f.write(json.dumps({"prompt": f"What is {a} plus {b}?\n", "response": f"{a + b}."}) + "\n")
print(sum(p.numel() for p in model.parameters()) / 1e9, "B params saved")
EOF
ls /tmp/w/hf_src

echo "== prepare"
timeout 60 $CLI prepare /tmp/w/pairs.jsonl --out /tmp/w/pairs --progress plain 2>&1 | tail -2
cat > /tmp/w/sft.json <<'EOF'
{"data": {"batch_size": 8, "seq_len": 1024, "val_fraction": 0.05},
 "optim": {"lr": 1e-4, "weight_decay": 0.0},
 "schedule": {"kind": "constant"},
 "loop": {"steps": 30, "log_every": 5, "eval_every": 10, "eval_batches": 2,
          "checkpoint_every": 15}}
EOF
echo "== fine-tune from the import"
timeout 400 $CLI train /tmp/w/sft.json model.hf_path=/tmp/w/hf_src data.source=/tmp/w/pairs \
  loop.run_dir=/tmp/w/run > /tmp/w/train.log 2>&1; echo "train rc=$?"
grep -v '^W' /tmp/w/train.log | tail -14
cat /tmp/w/run/eval.jsonl

echo "== export and load back"
timeout 200 $CLI export /tmp/w/run /tmp/w/hf_out --progress plain 2>&1 | tail -3
ls /tmp/w/hf_out
timeout 200 python3 benchmarks/hf_parity.py /tmp/w/hf_out --moved-from /tmp/w/hf_src
} 2>&1 | tee $W/summary.txt
cd /tmp && tar czf "$OUT_FINAL/all.tgz" --exclude='checkpoints' --exclude='*.safetensors' \
  --exclude='*.bin' w
