"""The tokenizers `megatrain-jax prepare` reads text with: bytes, or a Hugging Face
tokenizer (a tokenizer.json, or a model folder holding one, with its chat template).

    tokenizer = load_tokenizer("bytes")            # ids 0..255
    tokenizer = load_tokenizer("Llama-3.1-8B/")    # HFTokenizer: the `tokenizers` extra
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatrain_jax.config import ConfigError
from megatrain_jax.io.chat_template import find_chat_template
from megatrain_jax.io.data import ByteTokenizer

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")  # the variables a chat template sees
# A document's end where the tokenizer's eos_token is a chat marker (instruct tokenizers).
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# Tokens that mark a chat's turns (ChatML, Llama 3): never a text document's start or end,
# whether or not the folder holds the template that writes them.
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|start_header_id|>",
                "<|end_header_id|>", "<start_of_turn>", "<end_of_turn>")


class HFTokenizer:
    """A `tokenizer.json` through the `tokenizers` library, with bos/eos and chat template
    from the `tokenizer_config.json` (and `chat_template.jinja`) beside it."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ConfigError("a tokenizer.json needs the tokenizers library: "
                              "pip install 'megatrain-jax[tokenizers]'") from e
        path = Path(path)
        file = (path / "tokenizer.json" if path.is_dir() else path).resolve()
        if not file.is_file():
            raise ConfigError(f"--tokenizer: no tokenizer.json at '{path}'; give the file, a "
                              "folder holding it, or 'bytes'.")
        self.name = str(file)  # absolute: meta.json names it for readers anywhere
        self.tokenizer = Tokenizer.from_file(str(file))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        settings_file = file.with_name("tokenizer_config.json")
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        self.special = {k: _token_text(settings[k]) for k in SPECIAL_TOKENS
                        if _token_text(settings.get(k)) is not None}
        self.chat_template, self.template_source = find_chat_template(file.parent, settings)
        # Tokens a template writes are chat markers, and so are the known ones without it
        # (an instruct tokenizer's folder may hold no template).
        markers = (self.chat_template or "") + " ".join(CHAT_MARKERS)
        bos, eos = self.special.get("bos_token"), self.special.get("eos_token")
        self.bos_id, self.eos_id = self._id(bos), self._id(eos)
        self.document_bos_id = None if bos and bos in markers else self.bos_id
        ends = [eos] if eos and eos not in markers else []
        ends += [t for t in END_OF_TEXT if t not in markers]
        self.end_of_text = next((t for t in ends if self._id(t) is not None), None)
        self.end_of_text_id = self._id(self.end_of_text)

    def _id(self, text: str | None) -> int | None:
        return None if text is None else self.tokenizer.token_to_id(text)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int64)

    def decode(self, ids) -> str:
        """The text of `ids`, special tokens left out (as transformers' skip_special_tokens)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The ids of `text` as one piece, and each token's span of characters in it."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, np.int64), encoding.offsets

    def describe(self) -> str:
        ending = (f"{self.end_of_text} (id {self.end_of_text_id})" if self.end_of_text else
                  "nothing (no end-of-text token found)")
        template = (f"from {self.template_source}" if self.chat_template else
                    f"{self.template_source}: messages as 'role: content' lines")
        return (f"prepare: tokenizer {self.name}; chat template {template}; text documents "
                f"end with {ending}")


def _token_text(token):
    return token.get("content") if isinstance(token, dict) else token


def load_tokenizer(name: str):
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)
