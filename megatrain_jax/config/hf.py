"""A Hugging Face model folder's config.json as our model fields, without JAX or weights.

    fields = architecture("path/to/Llama-3.1-8B")     # {"hidden": 4096, "layers": 32, ...}
    section = resolve_model_fields({"hf_path": "path/to/Llama-3.1-8B"})

The config loader calls this before JAX starts, so that the memory plan and the pinned pool
are computed from the real model. Reading and writing the weights is `megatrain_jax.io.hf`.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatrain_jax.config.schema import ConfigError, ModelConfig

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class CheckpointFormatError(ConfigError):
    """A Hugging Face folder is missing, unsupported, or does not match its config.json."""


# ----- config.json <-> ModelConfig fields (no JAX) -------------------------------------------


def read_hf_config(path: str | Path) -> dict:
    folder = Path(path)
    file = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointFormatError(f"model.hf_path: no such folder '{folder}'.")
    if not file.is_file():
        raise CheckpointFormatError(f"model.hf_path: '{folder}' has no config.json; is it a "
                                    "Hugging Face model folder?")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{file} is not valid JSON: {e}") from e


def _rope(hf: dict) -> tuple[float, dict]:
    """(theta, our rope_scaling fields) from either transformers 4 or 5 keys."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), {"kind": "none"}
    if kind == "linear":
        return float(theta), {"kind": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        return float(theta), {
            "kind": "llama3", "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_position": int(scaling["original_max_position_embeddings"]),
        }
    raise CheckpointFormatError(f"rope scaling '{kind}' is not supported (supported: default, "
                                "linear, llama3).")


def architecture(path: str | Path) -> dict:
    """The model.* config fields that a Hugging Face folder's config.json fixes."""
    hf = read_hf_config(path)
    family = hf.get("model_type")
    where = f"{Path(path) / 'config.json'}"
    if family not in FAMILIES:
        raise CheckpointFormatError(
            f"{where}: model_type '{family}' is not supported; supported: {', '.join(FAMILIES)}.")
    unsupported = [
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')!r}"),
        (bool(hf.get("mlp_bias")), "mlp_bias=true"),
        (family in ("llama", "mistral", "qwen3") and bool(hf.get("attention_bias")),
         "attention_bias=true (a bias on the output projection)"),
        (bool(hf.get("use_sliding_window")), "use_sliding_window=true"),
    ]
    bad = [text for flag, text in unsupported if flag]
    if bad:
        raise CheckpointFormatError(f"{where}: {', '.join(bad)} is not supported.")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size")
    missing = [key for key in required if not isinstance(hf.get(key), int)]
    if missing:
        raise CheckpointFormatError(f"{where}: no integer {', '.join(missing)}.")
    heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    max_len = int(hf.get("max_position_embeddings", 4096))
    if family == "mistral" and hf.get("sliding_window"):
        # Within the window, sliding-window attention is plain causal attention.
        max_len = min(max_len, int(hf["sliding_window"]))
    return {
        "vocab_size": hf["vocab_size"], "hidden": hf["hidden_size"],
        "layers": hf["num_hidden_layers"], "heads": heads,
        "kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "ffn": hf["intermediate_size"], "rope_theta": theta, "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", family == "qwen2")),
        "qkv_bias": family == "qwen2", "qk_norm": family == "qwen3", "max_seq_len": max_len,
    }


def resolve_model_fields(model: dict) -> dict:
    """Fills `model` (a config section as a dict) from model.hf_path's config.json.

    A field set in the config that the checkpoint fixes to another value is an error, not
    silently replaced.
    """
    arch = architecture(model["hf_path"])
    defaults = ModelConfig()
    for key, value in arch.items():
        given = model.get(key)
        if key == "rope_scaling" and given is not None:
            given = {**vars(defaults.rope_scaling), **given}
            value = {**vars(defaults.rope_scaling), **value}
        if given is not None and given != value:
            raise CheckpointFormatError(
                f"model.{key}={given!r} differs from {value!r} in the checkpoint "
                f"{model['hf_path']}/config.json; remove model.{key} from the config.")
    return {**model, **arch}
