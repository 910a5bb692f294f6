"""The small Hugging Face fine-tune that failed to compile on the H200, through the CLI.

    PYTHONPATH=. python benchmarks/gemm_fallback_gpu.py        # JSON: $OUT/gemm_fallback.json

A random 3-layer Llama (hidden 64, 4 heads, 2 kv heads, ffn 160, vocab 300; saved by
transformers where it is installed, else by megatrain's own export), random tokens in a
`.npy`, and the overrides it failed with: model.compute_dtype=float32 model.attention=xla
data.batch_size=4 data.seq_len=40 data.micro_batches=2 stream.loss_chunk=100
loop.checkpoint_every=4, 8 steps. Each variant is one `megatrain-jax train` process:

    variant            matmuls   placement                           Triton GEMM fallback
    cli                highest   the planner's (resident, saved)     on (the fix)
    cli_no_fallback    highest   the planner's                       off (the failure)
    recompute          highest   stream.keep_layers=0                off
    default_precision  default   the planner's                       off
    tiny_shapes        highest   `tiny`, the same shapes, bundled    off
    xla_flag           highest   the planner's; XLA_FLAGS=--xla_gpu_enable_triton_gemm=false

and `parity`: the streamed trainer (the planner's placement, the fallback on) against the
reference trainer (jax.grad + optax) over the same 8 batches at HIGHEST precision: the
largest relative difference of their losses. The table is printed last.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"vocab_size": 300, "hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "ffn": 160}
OVERRIDES = ["model.compute_dtype=float32", "model.attention=xla", "data.batch_size=4",
             "data.seq_len=40", "data.micro_batches=2", "stream.loss_chunk=100",
             "loop.checkpoint_every=4", "loop.steps=8", "loop.log_every=1"]
FALLBACK_NOTE = "did not compile: XLA's GEMM autotuner"
# Run in a variant's process: the CLI, with the fallback switched off when asked.
CLI = """
import sys
if sys.argv[1] == "off":
    import megatrain_jax.stream.gemm_fallback as g
    g.autotuner_failure = lambda error: False
from megatrain_jax.cli import main
sys.exit(main(sys.argv[2:]))
"""


def hf_folder(folder: Path) -> str:
    """A random Llama of SHAPE saved as a Hugging Face folder; who saved it."""
    try:
        import torch
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden"],
            intermediate_size=SHAPE["ffn"], num_hidden_layers=SHAPE["layers"],
            num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"],
            tie_word_embeddings=False)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
        return f"transformers {transformers.__version__}"
    except ImportError:
        import jax

        from megatrain_jax import model
        from megatrain_jax.config import load_config
        from megatrain_jax.io import hf

        cfg = load_config("tiny", [f"model.{k}={v}" for k, v in SHAPE.items()]).model
        hf.save_params(model.init(cfg, jax.random.key(0)), cfg, folder)
        return "megatrain_jax.io.hf.save_params"


def variants(work: Path, folder: Path, tokens: Path) -> dict:
    """{name: (fallback on/off, config, overrides, environment changes)}."""
    config = work / "finetune.json"
    config.write_text(json.dumps({"optim": {"lr": 1e-3, "clip_norm": 1.0}}))
    hf = [f"model.hf_path={folder}", f"data.source={tokens}", *OVERRIDES]
    tiny = [*(f"model.{k}={v}" for k, v in SHAPE.items()),
            *(o for o in OVERRIDES if not o.startswith("model."))] + \
        ["model.compute_dtype=float32", "model.attention=xla"]
    highest = {"JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    return {
        "cli": ("on", str(config), hf, highest),
        "cli_no_fallback": ("off", str(config), hf, highest),
        "recompute": ("off", str(config), [*hf, "stream.keep_layers=0"], highest),
        "default_precision": ("off", str(config), hf, {"JAX_DEFAULT_MATMUL_PRECISION": None}),
        "tiny_shapes": ("off", "tiny", tiny, highest),
        "xla_flag": ("off", str(config), hf,
                     {**highest, "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}),
    }


def run_variant(name: str, spec: tuple, work: Path) -> dict:
    fallback, config, overrides, changes = spec
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key, value in changes.items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    argv = [sys.executable, "-c", CLI, fallback, "train", config, *overrides,
            f"loop.run_dir={work / name}"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    placement = re.search(r"placement: (.*)", done.stderr)
    errors = [line for line in done.stderr.splitlines()
              if "Error" in line or "INTERNAL" in line or "megatrain-jax:" in line]
    summary = {}
    if done.returncode == 0 and done.stdout.strip():
        summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {"variant": name, "rc": done.returncode, "fell_back": FALLBACK_NOTE in done.stderr,
            "placement": placement.group(1) if placement else None,
            "first_loss": summary.get("first_loss"), "last_loss": summary.get("last_loss"),
            "failure": next((e for e in errors if "INTERNAL" in e or "Error" in e), None),
            "stderr_tail": done.stderr[-3000:]}


PARITY = """
import json, sys
import jax, numpy as np
from megatrain_jax import model
from megatrain_jax.config import load_config
from megatrain_jax.io.data import TokenSource
from megatrain_jax.train import StreamTrainer
from megatrain_jax.train.reference import ReferenceTrainer
cfg = load_config(sys.argv[1], sys.argv[2:])
params = model.init(cfg.model, jax.random.key(0))
data, ref, stream = TokenSource(cfg), ReferenceTrainer(cfg), StreamTrainer(cfg)
ref_state, state = ref.init(None, params=params), stream.init(None, params=params)
rows = []
for step in range(cfg.loop.steps):
    batch = data.batch_at(step)
    ref_state, rm = ref.train_step(ref_state, batch)
    state, m = stream.train_step(state, batch)
    rows.append([float(m["loss"]), float(rm["loss"]), float(m["grad_norm"])])
print(json.dumps(rows))
"""


def parity(spec: tuple, work: Path) -> dict:
    _, config, overrides, changes = spec
    env = {**os.environ, **changes,
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = [sys.executable, "-c", PARITY, config, *overrides,
            f"loop.run_dir={work / 'parity'}"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        return {"variant": "parity", "rc": done.returncode, "stderr_tail": done.stderr[-3000:]}
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    worst = max(abs(a - b) / abs(b) for a, b, _ in rows)
    return {"variant": "parity", "rc": 0, "fell_back": FALLBACK_NOTE in done.stderr,
            "max_rel_loss_diff": worst, "steps": rows}


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    work = Path(tempfile.mkdtemp(prefix="gemm_fallback_"))
    folder, tokens = work / "llama", work / "tokens.npy"
    import numpy as np

    saved_by = hf_folder(folder)
    np.save(tokens, np.random.default_rng(0).integers(0, SHAPE["vocab_size"], 50_000)
            .astype(np.int32))
    specs = variants(work, folder, tokens)
    only = [n for n in os.environ.get("VARIANTS", "").split(",") if n]  # e.g. cli,parity
    results = [run_variant(name, spec, work) for name, spec in specs.items()
               if not only or name in only]
    if not only or "parity" in only:
        results.append(parity(specs["cli"], work))
    (out / "gemm_fallback.json").write_text(json.dumps(
        {"hf_folder_saved_by": saved_by, "results": results}, indent=1))
    print(f"HF folder saved by {saved_by}; JSON: {out / 'gemm_fallback.json'}")
    print(f"{'variant':18} {'rc':>3} {'fallback':>8} {'first':>8} {'last':>8}  "
          "placement / failure / parity")
    for r in results:
        note = (f"max rel loss diff vs jax.grad {r['max_rel_loss_diff']:.2e}"
                if "max_rel_loss_diff" in r else r.get("failure") or r.get("placement") or "")
        first, last = (("-" if r.get(k) is None else f"{r[k]:.4f}")
                       for k in ("first_loss", "last_loss"))
        print(f"{r['variant']:18} {r['rc']:>3} {str(r.get('fell_back', '')):>8} "
              f"{first:>8} {last:>8}  {str(note)[:110]}")


if __name__ == "__main__":
    main()
