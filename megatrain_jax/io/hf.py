"""Hugging Face checkpoints in and out: Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3.

    arch = architecture("path/to/Llama-3.1-8B")       # model.* fields from its config.json
    params = load_params("path/to/Llama-3.1-8B", cfg.model, put=placement.to_host)
    save_params(params, cfg.model, "out/", dtype="bfloat16", source="path/to/Llama-3.1-8B")

A checkpoint is a folder with config.json and one `model.safetensors` or several shards named
by `model.safetensors.index.json`. Loading reads one part of the model at a time (the
embedding, then each layer, then the head) through memory-mapped safetensors, converts it to
fp32 in our [in, out] layout and hands it to `put` (the host store's copy to pinned_host)
before the next part is read, so the whole model never exists twice in RAM. Saving writes
shards one at a time in the same layout `transformers` reads.

`architecture` needs neither JAX nor safetensors: the config loader calls it before JAX
starts, so that the memory plan and the pinned pool are computed from the real model.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from megatrain_jax.config import ConfigError, ModelConfig
from megatrain_jax.config.hf import (  # noqa: F401  (part of this module's API)
    FAMILIES,
    CheckpointFormatError,
    architecture,
    read_hf_config,
)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Files of a checkpoint folder that export copies along (tokenizer, generation settings).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "generation_config.json", "chat_template.jinja")

# Our layer field -> (name under model.layers.{i}., stored transposed [out, in] by torch).
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
EMBED_TENSOR = "model.embed_tokens.weight"
NORM_TENSOR = "model.norm.weight"
OUT_TENSOR = "lm_head.weight"
# Buffers some older checkpoints carry; recomputed here, so ignored.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_config(cfg: ModelConfig, dtype: str, source: dict | None = None) -> dict:
    """A config.json for `cfg`: the source checkpoint's own when known, else a new one."""
    if source:
        out = dict(source)
    else:
        family = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}[family]
        out = {
            "architectures": [arch], "model_type": family, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dh, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta,
            "rope_scaling": _hf_rope_scaling(cfg), "attention_bias": False,
        }
    out.pop("torch_dtype", None)
    out["dtype"] = dtype
    return out


def _hf_rope_scaling(cfg: ModelConfig) -> dict | None:
    r = cfg.rope_scaling
    if r.kind == "none":
        return None
    if r.kind == "linear":
        return {"rope_type": "linear", "factor": r.factor}
    return {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position}


# ----- tensors ---------------------------------------------------------------------------------


def tensor_names(cfg: ModelConfig) -> dict:
    """{part name: {our field: (hf name, transposed)}} in streaming order."""
    names = {"embed": {"table": (EMBED_TENSOR, False)}}
    layer_fields = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if cfg.qkv_bias:
        layer_fields += ["bq", "bk", "bv"]
    if cfg.qk_norm:
        layer_fields += ["q_norm", "k_norm"]
    for i in range(cfg.layers):
        names[f"layers.{i}"] = {f: (f"model.layers.{i}.{LAYER_TENSORS[f][0]}", LAYER_TENSORS[f][1])
                                for f in layer_fields}
    names["head"] = {"norm": (NORM_TENSOR, False)}
    if not cfg.tie_embeddings:
        names["head"]["out"] = (OUT_TENSOR, True)
    return names


def _part_shapes(cfg: ModelConfig) -> dict:
    """{part name: its abstract pytree}, in the order of `tensor_names`."""
    from megatrain_jax import model

    layer = model.abstract_layer(cfg)
    return {"embed": model.abstract_embed(cfg), **{f"layers.{i}": layer for i in range(cfg.layers)},
            "head": model.abstract_head(cfg)}


def _weight_map(folder: Path) -> dict[str, Path]:
    """{tensor name: file} for a single-file or sharded safetensors checkpoint."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointFormatError(f"{index} is not a safetensors index: {e}") from e
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / WEIGHTS
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(single, framework="numpy") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # noqa: BLE001 - truncated or corrupt header
            raise CheckpointFormatError(f"cannot read {single}: {type(e).__name__}: {e}") from e
    found = sorted(p.name for p in folder.iterdir())
    raise CheckpointFormatError(
        f"{folder} has neither {WEIGHTS} nor {INDEX} (found: {', '.join(found[:8])}); only "
        "safetensors checkpoints are read. Convert .bin weights with transformers' "
        "save_pretrained(..., safe_serialization=True).")


def _check_names(weight_map: dict, expected: dict, folder: Path) -> None:
    want = {hf for part in expected.values() for hf, _ in part.values()}
    have = {n for n in weight_map if not n.endswith(IGNORED_SUFFIXES)}
    missing, extra = sorted(want - have), sorted(have - want)
    if extra == [OUT_TENSOR]:  # tied in config.json, yet saved: the copy is not used
        extra = []
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors ({', '.join(missing[:4])})")
        if extra:
            parts.append(f"{len(extra)} tensors this model has no place for "
                         f"({', '.join(extra[:4])})")
        raise CheckpointFormatError(
            f"{folder} does not match its config.json: {'; '.join(parts)}.")


def load_params(path: str | Path, cfg: ModelConfig, put: Callable = lambda tree: tree,
                progress=None) -> dict:
    """{"embed", "layers": [...], "head"} read part by part; each part goes through `put`."""
    import numpy as np
    from safetensors import safe_open

    folder = Path(path)
    weight_map = _weight_map(folder)
    expected = tensor_names(cfg)
    _check_names(weight_map, expected, folder)
    shapes = _part_shapes(cfg)
    params = {"embed": None, "layers": [], "head": None}
    with ExitStack() as stack:
        handles = {}

        def read(name: str, transposed: bool, spec) -> np.ndarray:
            file = weight_map[name]
            try:
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(file, framework="numpy"))
                stored = handles[file].get_tensor(name)
            except Exception as e:  # noqa: BLE001 - missing, truncated or corrupt file
                raise CheckpointFormatError(f"cannot read {name} from {file}: "
                                            f"{type(e).__name__}: {e}") from e
            want = spec.shape[::-1] if transposed else spec.shape  # as torch stores it
            if stored.shape != want:
                raise CheckpointFormatError(f"{name} in {file} has shape {list(stored.shape)}; "
                                            f"the config implies {list(want)}.")
            return np.ascontiguousarray(stored.T if transposed else stored, dtype=np.float32)

        for done, (part, fields) in enumerate(expected.items(), 1):
            spec_tree = shapes[part]
            values = {f: read(hf, t, getattr(spec_tree, f)) for f, (hf, t) in fields.items()}
            tree = put(type(spec_tree)(**values))  # fields not read stay None
            if part.startswith("layers."):
                params["layers"].append(tree)
            else:
                params[part] = tree
            if progress is not None:
                progress.update(done, {"part": part})
    return params


def save_params(params: dict, cfg: ModelConfig, out_dir: str | Path, dtype: str = "float32",
                source: str | Path | None = None, max_shard_bytes: int = 5 * 2**30,
                progress=None) -> Path:
    """Writes `params` as a Hugging Face folder (sharded safetensors + config.json).

    The folder is written under a temporary name and renamed when complete. Files beside the
    source checkpoint's weights (tokenizer, generation config) are copied along.
    """
    import numpy as np
    from safetensors.numpy import save_file

    np_dtype = _numpy_dtype(dtype)
    out = Path(out_dir)
    if out.exists():
        raise ConfigError(f"{out} already exists; export into a new folder.")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    trees = {"embed": params["embed"], "head": params["head"],
             **{f"layers.{i}": p for i, p in enumerate(params["layers"])}}
    plan = shard_plan(cfg, dtype, max_shard_bytes)
    total_bytes, weight_map = 0, {}
    for k, shard in enumerate(plan, 1):
        file = WEIGHTS if len(plan) == 1 else f"model-{k:05d}-of-{len(plan):05d}.safetensors"
        tensors = {}
        for part, field, hf, transposed in shard:
            array = np.asarray(getattr(trees[part], field))
            tensors[hf] = np.ascontiguousarray((array.T if transposed else array).astype(np_dtype))
            weight_map[hf] = file
            total_bytes += tensors[hf].nbytes
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
        if progress is not None:
            progress.update(k, {"file": file})
    if len(plan) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    source_config = read_hf_config(source) if source else None
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg, dtype, source_config), indent=2)
                                     + "\n")
    for name in SIDE_FILES if source else ():
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, tmp / name)
    # Files readable by all, as the umask allows (safetensors writes its own 0600).
    umask = os.umask(0)
    os.umask(umask)
    for file in tmp.iterdir():
        file.chmod(0o666 & ~umask)
    tmp.chmod(0o777 & ~umask)
    tmp.rename(out)
    return out


def _numpy_dtype(dtype: str):
    import ml_dtypes
    import numpy as np

    found = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
             "float16": np.float16}.get(dtype)
    if found is None:
        raise ConfigError(f"export dtype '{dtype}' is not one of float32, bfloat16, float16.")
    return np.dtype(found)


def shard_plan(cfg: ModelConfig, dtype: str, max_shard_bytes: int = 5 * 2**30) -> list:
    """Tensors per file, in order: [[(part, field, hf name, transposed), ...], ...].

    Planned from shapes alone, so that each file's name (and a progress bar) can know the
    count before anything is written.
    """
    itemsize = _numpy_dtype(dtype).itemsize
    shapes = _part_shapes(cfg)
    plan, size = [[]], 0
    for part, fields in tensor_names(cfg).items():
        for field, (hf, transposed) in fields.items():
            n = itemsize
            for dim in getattr(shapes[part], field).shape:
                n *= dim
            if plan[-1] and size + n > max_shard_bytes:
                plan.append([])
                size = 0
            plan[-1].append((part, field, hf, transposed))
            size += n
    return plan
