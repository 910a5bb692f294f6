"""Tokens in, batches out.

A `TokenSource` is a flat array of token ids. `batch_at(step)` draws `batch_size` windows of
`seq_len + 1` tokens from it with an RNG seeded by (seed, step), so the batch of any step
is known without replaying earlier ones: resuming at step N gives the same data order.

Sources: `bundled` (a public-domain English text shipped with the package, through the
byte-level tokenizer), `random` (uniform ids, the benchmark workload), or a path to a token
file (`.npy`, or raw `.bin` of uint16/uint32 with a `.json` beside it naming the dtype).
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import numpy as np

from megatrain_jax.config import Config, ConfigError


class ByteTokenizer:
    """Bytes are tokens: ids 0..255, no vocabulary file, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def bundled_text() -> str:
    """Genesis, Ruth, Esther, Proverbs and Ecclesiastes (King James Version, 1611)."""
    blob = resources.files("megatrain_jax").joinpath("kjv_excerpt.txt.gz").read_bytes()
    return gzip.decompress(blob).decode("utf-8")


def _load_token_file(path: Path) -> np.ndarray:
    if not path.exists():
        raise ConfigError(f"data.source: no such token file '{path}'.")
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r")
    meta = path.with_suffix(".json")
    dtype = json.loads(meta.read_text())["dtype"] if meta.exists() else "uint16"
    return np.memmap(path, dtype=dtype, mode="r")


class TokenSource:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        d, vocab = cfg.data, cfg.model.vocab_size
        if d.source == "random":
            self.tokens = None
        elif d.source == "bundled":
            self.tokens = ByteTokenizer().encode(bundled_text())
            if vocab < ByteTokenizer.vocab_size:
                raise ConfigError(
                    f"data.source=bundled uses byte tokens (ids 0..255) but model.vocab_size "
                    f"is {vocab}; set model.vocab_size >= 256."
                )
        else:
            self.tokens = _load_token_file(Path(d.source))
            self._check_ids(vocab)
        if self.tokens is not None and len(self.tokens) < d.seq_len + 1:
            raise ConfigError(
                f"data.source has {len(self.tokens)} tokens, fewer than one sequence of "
                f"data.seq_len + 1 = {d.seq_len + 1}; lower data.seq_len or add data."
            )

    def _check_ids(self, vocab: int) -> None:
        if len(self.tokens) == 0:
            raise ConfigError(f"data.source '{self.cfg.data.source}' holds no tokens.")
        top = int(np.max(self.tokens))
        if top >= vocab or int(np.min(self.tokens)) < 0:
            raise ConfigError(
                f"data.source holds token id {top}, outside the vocabulary of "
                f"model.vocab_size={vocab}; was it prepared with another tokenizer?"
            )

    def batch_at(self, step: int) -> dict:
        """{'inputs', 'targets': int32 [B, S], 'mask': float32 [B, S]} for `step`."""
        d = self.cfg.data
        rng = np.random.default_rng([d.seed, step])
        if self.tokens is None:
            windows = rng.integers(0, self.cfg.model.vocab_size, (d.batch_size, d.seq_len + 1))
        else:
            starts = rng.integers(0, len(self.tokens) - d.seq_len, d.batch_size)
            windows = np.stack([self.tokens[s:s + d.seq_len + 1] for s in starts])
        windows = windows.astype(np.int32)
        return {
            "inputs": windows[:, :-1],
            "targets": windows[:, 1:],
            "mask": np.ones((d.batch_size, d.seq_len), np.float32),
        }
