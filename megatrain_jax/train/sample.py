"""`megatrain-jax sample`: what a model says, from a run's checkpoint or a Hugging Face folder.

    model = load_model("runs/chat")                      # the latest checkpoint; or an HF folder
    ids = prompt_ids(model, "Who was Ruth?")              # the chat template, where it has one
    new = generate(model, ids, max_new_tokens=64)         # greedy; temperature=, top_p=, seed=
    model.tokenizer.decode(new)

The weights go to the GPU whole (in `dtype`: float32, or bfloat16 for half the memory), the
layers stacked so that one layer program serves every layer. The prompt is prefilled in one
pass, padded to a multiple of PROMPT_BUCKET tokens (one program per bucket), then each token
is one call of a program of fixed shape over a KV cache of the prompt's and the new tokens'
positions (model/decode.py). Generation stops after `max_new_tokens` or at an end token: the
tokenizer's eos and end-of-text, and the model folder's generation_config.json eos_token_id.
"""

from __future__ import annotations

import dataclasses
import json
import time
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.config import ConfigError, ModelConfig, load_config
from megatrain_jax.io import hf
from megatrain_jax.io.chat_template import compile_chat_template
from megatrain_jax.io.checkpoint import Checkpointer, CheckpointError
from megatrain_jax.io.run_folder import run_config
from megatrain_jax.io.tokenizer import load_tokenizer
from megatrain_jax.model import decode
from megatrain_jax.stream.placement import Placement
from megatrain_jax.train.export import read_params

PROMPT_BUCKET = 64


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    params: dict  # {"embed", "layers": stacked, "head"} on the device
    tokenizer: object
    stop_ids: frozenset
    source: str  # what was read, for the user: "runs/x checkpoint 500", "HF folder ..."


def _model_folder(source: Path) -> tuple[str, Path | None]:
    """("run" or "hf", the HF folder whose tokenizer and generation settings apply)."""
    if (source / "checkpoints").is_dir():
        return "run", None
    if (source / "config.json").is_file() and "model_type" in hf.read_hf_config(source):
        return "hf", source
    raise ConfigError(f"sample: {source} is neither a training run's folder (with "
                      "checkpoints/) nor a Hugging Face model folder (config.json with a "
                      "model_type); give one of those.")


def _read_weights(source: Path, kind: str, step: int | None, dtype: str):
    """(model config in `dtype`, host parameters, what was read)."""
    if kind == "hf":
        cfg = load_config(None, [f"model.hf_path={source}"]).model
        params, what = hf.load_params(source, cfg), f"{source}"
    else:
        run = run_config(source, step)[0]
        ckpt = Checkpointer(source / "checkpoints")
        try:
            step = ckpt.latest_step() if step is None else step
            if step is None:
                raise CheckpointError(f"{source / 'checkpoints'} holds no complete checkpoint; "
                                      "train with loop.checkpoint_every=N to write some.")
            params, what = read_params(ckpt, step, run), f"{source} checkpoint {step}"
        finally:
            ckpt.close()
        cfg = run.model
    return dataclasses.replace(cfg, compute_dtype=dtype), params, what


def _tokenizer_path(source: Path, kind: str, given: str | None) -> str:
    """--tokenizer, else the model folder's, else the one the run's data was prepared with."""
    if given:
        return given
    if kind == "hf":
        return str(source)
    cfg = run_config(source)[0]
    if cfg.model.hf_path and (Path(cfg.model.hf_path) / "tokenizer.json").is_file():
        return cfg.model.hf_path
    meta = Path(cfg.data.source) / "meta.json"
    if meta.is_file():
        return json.loads(meta.read_text())["tokenizer"]
    if cfg.data.source == "bundled" or cfg.model.vocab_size == 256:
        return "bytes"
    raise ConfigError(f"sample: no tokenizer found for {source} (its model.hf_path and "
                      f"data.source {cfg.data.source} name none); give --tokenizer with a "
                      "tokenizer.json or the folder holding it.")


def _stop_ids(tokenizer, folder: Path | None) -> frozenset:
    ids = {getattr(tokenizer, "eos_id", None), getattr(tokenizer, "end_of_text_id", None)}
    settings = folder / "generation_config.json" if folder else None
    if settings is not None and settings.is_file():
        eos = json.loads(settings.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos])
    return frozenset(i for i in ids if i is not None)


def load_model(source: str | Path, step: int | None = None, dtype: str = "float32",
               tokenizer: str | None = None) -> LoadedModel:
    """A run's checkpoint `step` (default: the latest) or a Hugging Face folder, on the
    device, with its tokenizer and end tokens."""
    source = Path(source)
    kind, folder = _model_folder(source)
    tok = load_tokenizer(_tokenizer_path(source, kind, tokenizer))
    cfg, params, what = _read_weights(source, kind, step, dtype)
    if kind == "run" and cfg.hf_path and Path(cfg.hf_path).is_dir():
        folder = Path(cfg.hf_path)
    cast = partial(np.asarray, dtype=jnp.dtype(dtype))
    host = {"embed": jax.tree.map(cast, params["embed"]),
            "layers": jax.tree.map(lambda *xs: cast(np.stack(xs)), *params["layers"]),
            "head": jax.tree.map(cast, params["head"])}
    on_device = Placement().to_device(host)
    return LoadedModel(cfg, on_device, tok, _stop_ids(tok, folder), what)


def prompt_ids(model: LoadedModel, prompt: str, chat: str = "auto") -> np.ndarray:
    """The prompt's token ids: rendered as one user message with the chat template and the
    assistant's turn begun (chat "on", or "auto" where the tokenizer has a template), else
    the text after the tokenizer's document start, as `prepare` writes a text document."""
    tok = model.tokenizer
    template = getattr(tok, "chat_template", None)
    if chat == "on" and not template:
        raise ConfigError(f"sample --chat on: the tokenizer {tok.name} has no chat template; "
                          "use --chat off.")
    if template and chat != "off":
        render = compile_chat_template(template)
        text = render([{"role": "user", "content": prompt}], tok.special,
                      add_generation_prompt=True)
        return tok.encode(text)
    bos = getattr(tok, "document_bos_id", tok.bos_id)
    return np.concatenate([[bos] if bos is not None else [], tok.encode(prompt)]).astype(np.int64)


@partial(jax.jit, static_argnames="cfg")
def _prefill(params, tokens, length, cache, cfg):
    return decode.prefill(params, tokens, length, cache, cfg)


@partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def _next(params, logits, position, cache, key, temperature, top_p, cfg):
    """The token after `logits` (at `position`), and the logits that follow it."""
    token = decode.choose(logits, key, temperature, top_p)
    logits, cache = decode.decode(params, token, position, cache, cfg)
    return token, logits, cache


def generate(model: LoadedModel, ids, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, on_token: Callable | None = None) -> list[int]:
    """The new token ids after prompt `ids` (greedy where `temperature` is 0), up to an end
    token (left out) or `max_new_tokens`; `on_token(ids so far)` follows each."""
    cfg, n = model.cfg, len(ids)
    padded = -(-n // PROMPT_BUCKET) * PROMPT_BUCKET
    length = -(-(padded + max_new_tokens) // PROMPT_BUCKET) * PROMPT_BUCKET
    tokens = np.zeros((1, padded), np.int32)
    tokens[0, :n] = ids
    cache = decode.empty_cache(cfg, 1, length)
    logits, cache = _prefill(model.params, tokens, np.int32(n), cache, cfg)
    key, new = jax.random.key(seed), []
    for position in range(n, n + max_new_tokens):
        key, draw = jax.random.split(key)
        token, logits, cache = _next(model.params, logits, np.int32(position), cache,
                                     draw, np.float32(temperature), np.float32(top_p), cfg)
        token = int(token[0])
        if token in model.stop_ids:
            break
        new.append(token)
        if on_token is not None:
            on_token(new)
    return new


def check_settings(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Refuses settings out of range, naming the flag, before any model is read."""
    for ok, flag, value, fix in (
            (max_new_tokens >= 1, "--max-new-tokens", max_new_tokens, "a count >= 1"),
            (temperature >= 0, "--temperature", temperature, "0 (greedy) or more"),
            (0 < top_p <= 1, "--top-p", top_p, "a probability in (0, 1]")):
        if not ok:
            raise ConfigError(f"sample {flag}={value} is out of range; give {fix}.")


def timed(fn: Callable, *args, **kwargs):
    """(fn's result, seconds it took)."""
    start = time.perf_counter()
    return fn(*args, **kwargs), time.perf_counter() - start

