"""Tokens in, batches out.

A `TokenSource` draws the batch of any step without replaying earlier ones, so resuming at
step N gives the same data order. Sources (`data.source`):

    bundled      a public-domain English text shipped with the package, as byte tokens
    random       uniform ids: the benchmark workload
    FOLDER       a folder written by `megatrain-jax prepare` (text or instruction data)
    FILE         a token file: `.npy`, or raw `.bin` of uint16/uint32 with a `.json` beside
                 it naming the dtype

Text is a stream of tokens: each row is a window of `seq_len + 1` tokens at a position drawn
by an RNG seeded with (seed, step). Instruction data is a list of examples, each with a loss
mask: examples are shuffled by (seed, epoch) and packed greedily into rows of `seq_len + 1`;
`segment_ids` keep packed examples from attending to each other, `positions` restart at each
example, and the loss counts only response tokens whose input belongs to the same example.

`data.val_fraction` holds out the end of the text stream, or that share of the examples
(chosen by the seed), for `split="val"`; validation batches are the same at every eval.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import numpy as np

from megatrain_jax.config import Config, ConfigError

META = "megatrain-tokens/1"  # meta.json's format tag in a prepared folder


class ByteTokenizer:
    """Bytes are tokens: ids 0..255, no vocabulary file, nothing to download."""

    vocab_size = 256
    name, bos_id, eos_id, chat_template = "bytes", None, None, None  # none of these

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def bundled_text() -> str:
    """Genesis, Ruth, Esther, Proverbs and Ecclesiastes (King James Version, 1611)."""
    blob = resources.files("megatrain_jax.io").joinpath("kjv_excerpt.txt.gz").read_bytes()
    return gzip.decompress(blob).decode("utf-8")


def _load_token_file(path: Path) -> np.ndarray:
    """The ids of a token file (memory-mapped): `.npy`, or raw `.bin` with an optional `.json`
    beside it naming the dtype (uint16 without one). Anything else is refused: a text or JSONL
    file must be tokenized by `prepare` first."""
    if path.suffix not in (".npy", ".bin"):
        raise ConfigError(
            f"data.source: {path} is not a token file (.npy or .bin); text and JSONL are "
            f"tokenized first: `megatrain-jax prepare {path} --out DIR`, then train with "
            "data.source=DIR.")
    try:
        if path.suffix == ".npy":
            tokens = np.load(path, mmap_mode="r")
        else:
            meta = path.with_suffix(".json")
            dtype = json.loads(meta.read_text())["dtype"] if meta.exists() else "uint16"
            tokens = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else \
                np.zeros(0, dtype)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"data.source: cannot read {path} as tokens ({type(e).__name__}: "
                          f"{e}).") from None
    if not np.issubdtype(tokens.dtype, np.integer) or tokens.ndim != 1:
        raise ConfigError(
            f"data.source: {path} holds {tokens.dtype} values of shape {tokens.shape}; a token "
            "file holds a 1-D array of integer ids (uint16, uint32 or int32). `megatrain-jax "
            "prepare` writes one from text.")
    return tokens


def _load_prepared(folder: Path) -> tuple[dict, np.ndarray, np.ndarray | None, np.ndarray]:
    """(meta, tokens, loss mask or None, document starts) of a `prepare` folder."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"data.source: {folder} is not a prepared folder (meta.json: {e}); "
                          "make one with `megatrain-jax prepare`.") from e
    if meta.get("format") != META:
        raise ConfigError(f"data.source: {folder}/meta.json is not of format {META}.")
    try:
        tokens = np.memmap(folder / "tokens.bin", dtype=meta["dtype"], mode="r") \
            if meta["tokens"] else np.zeros(0, np.uint16)
        mask = None
        if meta["kind"] == "sft":
            mask = np.memmap(folder / "loss_mask.bin", dtype=np.uint8, mode="r")
        starts = np.load(folder / "documents.npy")
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"data.source: {folder} is an incomplete prepared folder "
                          f"({type(e).__name__}: {e}); prepare it again.") from None
    if len(tokens) != meta["tokens"]:
        raise ConfigError(f"data.source: {folder}/tokens.bin holds {len(tokens)} tokens, "
                          f"meta.json says {meta['tokens']}; prepare it again.")
    return meta, tokens, mask, starts


class TokenSource:
    def __init__(self, cfg: Config, split: str = "train"):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.cfg, self.split = cfg, split
        d, vocab = cfg.data, cfg.model.vocab_size
        self.tokens = self.loss_mask = self.examples = None
        self.kind = "text"
        self._epochs: list = []  # training rows of each epoch, packed when first needed
        self._val_rows: list | None = None
        if d.source == "random":
            return
        source = Path(d.source)
        if d.source == "bundled":
            self.tokens = ByteTokenizer().encode(bundled_text())
            if vocab < ByteTokenizer.vocab_size:
                raise ConfigError(
                    f"data.source=bundled uses byte tokens (ids 0..255) but model.vocab_size "
                    f"is {vocab}; set model.vocab_size >= 256."
                )
        elif source.is_dir():
            meta, self.tokens, self.loss_mask, starts = _load_prepared(source)
            self.kind = meta["kind"]
            if meta["vocab_size"] > vocab:  # else the tokenizer itself bounds the ids
                self._check_ids(vocab, f"(tokenizer {meta['tokenizer']})")
            if self.kind == "sft":
                self.examples = self._split_examples(starts)
        elif source.exists():
            self.tokens = _load_token_file(source)
            self._check_ids(vocab)
        else:
            raise ConfigError(f"data.source: no such file or folder '{source}' (or: bundled, "
                              "random).")
        if self.kind == "text":
            self.tokens = self._split_text(self.tokens)

    def _check_ids(self, vocab: int, origin: str = "") -> None:
        if len(self.tokens) == 0:
            raise ConfigError(f"data.source '{self.cfg.data.source}' holds no tokens.")
        low, top = int(np.min(self.tokens)), int(np.max(self.tokens))
        if low < 0:
            raise ConfigError(f"data.source holds token id {low}: ids are never negative; "
                              "the file is not tokens, or not of the dtype it was read as.")
        if top >= vocab:
            raise ConfigError(
                f"data.source holds token id {top}, outside the vocabulary of "
                f"model.vocab_size={vocab}{' ' + origin if origin else ''}; was it prepared "
                "with another tokenizer?"
            )

    def _split_text(self, tokens: np.ndarray) -> np.ndarray:
        d = self.cfg.data
        held_out = int(len(tokens) * d.val_fraction)
        part = tokens[len(tokens) - held_out:] if self.split == "val" else \
            tokens[:len(tokens) - held_out]
        if len(part) < d.seq_len + 1:
            where = "" if not d.val_fraction else \
                f" of its {self.split} split (data.val_fraction={d.val_fraction})"
            raise ConfigError(
                f"data.source has {len(part)} tokens{where}, fewer than one sequence of "
                f"data.seq_len + 1 = {d.seq_len + 1}; lower data.seq_len or add data."
            )
        return part

    def _split_examples(self, starts: np.ndarray) -> np.ndarray:
        """[N, 2] (start, length) of this split's examples, cut to seq_len + 1 tokens."""
        d = self.cfg.data
        count = len(starts) - 1
        order = np.random.default_rng([d.seed, 7]).permutation(count)
        held_out = int(round(count * d.val_fraction))
        if d.val_fraction and held_out == 0:
            held_out = 1
        chosen = order[:held_out] if self.split == "val" else order[held_out:]
        if len(chosen) == 0:
            raise ConfigError(f"data.source holds {count} examples, none left for the "
                              f"{self.split} split; lower data.val_fraction or add data.")
        chosen = np.sort(chosen)
        lengths = np.minimum(starts[chosen + 1] - starts[chosen], d.seq_len + 1)
        examples = np.stack([starts[chosen], lengths], axis=1)
        trained = sum(int(self.loss_mask[s + 1:s + n].sum()) for s, n in examples)
        if trained == 0:
            raise ConfigError(f"no response token of the {self.split} split lies within "
                              f"data.seq_len={d.seq_len}; raise data.seq_len.")
        return examples

    # ----- batches ---------------------------------------------------------------------------

    def batch_at(self, step: int) -> dict:
        """{'inputs', 'targets': int32 [B, S], 'mask': float32 [B, S]} for `step`, plus
        'segment_ids' and 'positions' for packed instruction data."""
        if self.kind == "sft":
            return self._packed(self._rows(step))
        d = self.cfg.data
        # The validation split draws from its own stream, the same at every eval.
        rng = np.random.default_rng([d.seed, step] + ([1] if self.split == "val" else []))
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

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        """Greedy packing of examples (indices into self.examples) into rows."""
        room = self.cfg.data.seq_len + 1
        rows, current, used = [], [], 0
        for k in order:
            n = int(self.examples[k, 1])
            if current and used + n > room:
                rows.append(current)
                current, used = [], 0
            current.append(int(k))
            used += n
        rows.append(current)
        return rows

    def _rows(self, step: int) -> list[list[int]]:
        d = self.cfg.data
        if self.split == "val":  # no shuffling: the same rows at every eval
            if self._val_rows is None:
                self._val_rows = self._pack(np.arange(len(self.examples)))
            rows = self._val_rows
            return [rows[(step * d.batch_size + b) % len(rows)] for b in range(d.batch_size)]
        # Training rows: epoch after epoch, each a fresh permutation packed anew.
        first = step * d.batch_size
        out, seen, epoch = [], 0, 0
        while len(out) < d.batch_size:
            if epoch == len(self._epochs):
                order = np.random.default_rng([d.seed, epoch]).permutation(len(self.examples))
                self._epochs.append(self._pack(order))
            rows = self._epochs[epoch]
            for index in range(max(first + len(out) - seen, 0), len(rows)):
                if len(out) == d.batch_size:
                    break
                out.append(rows[index])
            seen += len(rows)
            epoch += 1
        return out

    def _packed(self, rows: list[list[int]]) -> dict:
        d = self.cfg.data
        width = d.seq_len + 1
        tokens = np.zeros((len(rows), width), np.int32)
        trained = np.zeros((len(rows), width), np.float32)
        segments = np.zeros((len(rows), width), np.int32)  # 0: padding
        positions = np.zeros((len(rows), width), np.int32)
        for b, row in enumerate(rows):
            offset = 0
            for number, k in enumerate(row, 1):
                start, n = self.examples[k]
                tokens[b, offset:offset + n] = self.tokens[start:start + n]
                trained[b, offset:offset + n] = self.loss_mask[start:start + n]
                segments[b, offset:offset + n] = number
                positions[b, offset:offset + n] = np.arange(n)
                offset += n
        # A target counts when it is a response token of the same example as its input.
        same = (segments[:, :-1] == segments[:, 1:]) & (segments[:, :-1] > 0)
        return {
            "inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "mask": trained[:, 1:] * same,
            "segment_ids": segments[:, :-1], "positions": positions[:, :-1],
        }
