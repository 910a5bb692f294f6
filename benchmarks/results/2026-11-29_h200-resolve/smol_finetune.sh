# The README's fine-tune recipe (finetune.json beside this script, as the README writes it) on a
# SmolLM2-135M-shaped Llama (576 wide, 30 layers, 9 heads, 3 kv heads, tied embeddings), in
# bfloat16 and with FP8 projections from the same start. No pretrained weights on the box: the
# start is the same shape pretrained here on the bundled English text (bf16) and exported as a
# Hugging Face folder; the fine-tune data is the Python standard library's source as bytes.
# Usage: bash smol_finetune.sh OUT [PRETRAIN_STEPS] [FINETUNE_STEPS] [extra model overrides]
set -e
out=$1; pre=${2:-400}; ft=${3:-300}; shift 3 || true
here=$(dirname "$0")
smol="model.vocab_size=49152 model.hidden=576 model.layers=30 model.heads=9 model.kv_heads=3
  model.ffn=1536 model.tie_embeddings=true model.rope_theta=100000 model.max_seq_len=2048"
work=${WORK:-/tmp/smol}
rm -rf $work && mkdir -p $work
python -m megatrain_jax.cli train demo $smol model.compute_dtype=bfloat16 \
  data.batch_size=16 data.seq_len=1024 optim.lr=1e-3 loop.steps=$pre loop.eval_every=0 \
  loop.log_every=50 loop.progress=plain loop.run_dir=$work/pre loop.export_dir=$work/hf "$@" \
  > $out/smol_pretrain.log 2>&1
lib=$(python -c "import os, json; print(os.path.dirname(os.path.dirname(json.__file__)))")
python -m megatrain_jax.cli prepare "$lib/*.py" --tokenizer bytes --out $work/pydata \
  --progress none > $out/smol_prepare.log 2>&1
python benchmarks/quality.py $here/finetune.json --compare model.fp8_matmuls=false,true \
  --name smol_ft --out $out model.hf_path=$work/hf data.source=$work/pydata loop.steps=$ft \
  loop.eval_every=50 loop.checkpoint_every=0 loop.final_checkpoint=false loop.stop_save=false \
  "$@" > $out/smol_finetune.log 2>&1
tail -6 $out/smol_finetune.log
