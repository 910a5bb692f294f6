"""`megatrain-jax prepare`: text files or JSONL into a folder of token memmaps.

    prepare(["books/*.txt"], "data/books")                            # byte-level tokens
    prepare(["chat.jsonl"], "data/chat", tokenizer="Llama-3.1-8B/")   # tokenizer.json

Inputs are read one document at a time and their tokens appended to the output files, so a
dataset larger than memory is fine (a `.json` file, an array of records, is read whole).
What a line of JSONL holds decides the kind of data:

    {"text": "..."}                                   text: every token is trained on
    {"prompt": "...", "response": "..."}              instruction: loss on the response only
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}

A plain text file is one text document. Instruction examples get a per-token loss mask
(1 on the assistant's tokens and the end-of-sequence token). Chat messages are rendered with
the tokenizer's chat template when it has one (needs jinja2), else as "role: content" lines.

The folder (written under a temporary name, renamed when complete):

    meta.json         kind, dtype, token and document counts, tokenizer, vocab size, bos/eos ids
    tokens.bin        every document's tokens, one after another (uint16, or uint32 if needed)
    documents.npy     int64 [D+1]: where each document starts, and the end
    loss_mask.bin     uint8 per token (instruction data only)
"""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path

import numpy as np

from megatrain_jax.config import ConfigError
from megatrain_jax.io.data import META, ByteTokenizer
from megatrain_jax.tools.progress import Progress


class HFTokenizer:
    """A `tokenizer.json` through the `tokenizers` library, with bos/eos and chat template
    from the `tokenizer_config.json` beside it."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ConfigError("a tokenizer.json needs the tokenizers library: "
                              "pip install 'megatrain-jax[tokenizers]'") from e
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"--tokenizer: no tokenizer.json at '{path}'; give the file, a "
                              "folder holding it, or 'bytes'.")
        self.name = str(file)
        self.tokenizer = Tokenizer.from_file(str(file))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        settings_file = file.with_name("tokenizer_config.json")
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        self.bos_id = self._id(settings.get("bos_token"))
        self.eos_id = self._id(settings.get("eos_token"))
        self.chat_template = settings.get("chat_template")
        self.special = {k: _token_text(settings.get(k)) for k in ("bos_token", "eos_token")}

    def _id(self, token) -> int | None:
        text = _token_text(token)
        return None if text is None else self.tokenizer.token_to_id(text)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int64)


def _token_text(token):
    return token.get("content") if isinstance(token, dict) else token


def load_tokenizer(name: str):
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)


def _documents(files: list[Path]):
    """Yields (record, bytes read so far) for every document of every input file."""
    done = 0
    for file in files:
        if file.suffix == ".json":  # one JSON array of records
            try:
                records = json.loads(file.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{file} is not valid JSON: {e}") from e
            if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
                raise ConfigError(f"{file}: expected a JSON array of objects (or use .jsonl).")
            done += file.stat().st_size
            for number, record in enumerate(records, 1):
                yield record, f"{file}[{number - 1}]", done
        elif file.suffix == ".jsonl":
            with open(file, "rb") as f:
                for number, line in enumerate(f, 1):
                    done += len(line)
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"{file}:{number} is not valid JSON: {e}") from e
                    if not isinstance(record, dict):
                        raise ConfigError(f"{file}:{number}: expected a JSON object per line.")
                    yield record, f"{file}:{number}", done
        else:
            text = file.read_text(encoding="utf-8", errors="replace")
            done += file.stat().st_size
            yield {"text": text}, str(file), done


def _kind(record: dict, where: str) -> str:
    if "text" in record:
        return "text"
    if "messages" in record or ("prompt" in record and "response" in record):
        return "sft"
    raise ConfigError(f"{where}: a record needs 'text', 'prompt' and 'response', or "
                      f"'messages'; it has {sorted(record)}.")


def _plain_chat(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n\n" for m in messages)


def _spans(record: dict, tokenizer, where: str) -> list[tuple[str, bool]]:
    """(text, trained on) pieces of an instruction example, in order."""
    if "prompt" in record:
        return [(record["prompt"], False), (record["response"], True)]
    messages = record["messages"]
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ConfigError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects.")
    render = _plain_chat
    if tokenizer.chat_template:
        try:
            import jinja2
        except ImportError as e:
            raise ConfigError("the tokenizer has a chat template, which needs jinja2: "
                              "pip install jinja2") from e
        template = jinja2.Environment().from_string(tokenizer.chat_template)
        render = lambda ms: template.render(messages=ms, add_generation_prompt=False,  # noqa: E731
                                            **tokenizer.special)
    # Each message's text is what rendering it adds to the conversation before it.
    pieces, before = [], ""
    for k, message in enumerate(messages):
        text = render(messages[:k + 1])
        if not text.startswith(before):
            raise ConfigError(f"{where}: the chat template does not render messages "
                              "incrementally; use prompt/response records.")
        pieces.append((text[len(before):], message["role"] == "assistant"))
        before = text
    return pieces


def _encode(record: dict, kind: str, tokenizer, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A document's tokens and its loss mask (ones for text)."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    if kind == "text":
        tokens = np.concatenate([bos, tokenizer.encode(record["text"]), eos]).astype(np.int64)
        return tokens, np.ones(len(tokens), np.uint8)
    templated = "messages" in record and tokenizer.chat_template
    pieces = [(np.asarray([] if templated else bos, np.int64), False)]
    pieces += [(tokenizer.encode(text), trained) for text, trained in _spans(record, tokenizer,
                                                                           where)]
    pieces.append((np.asarray(eos, np.int64), True))
    tokens = np.concatenate([p for p, _ in pieces]).astype(np.int64)
    mask = np.concatenate([np.full(len(p), trained, np.uint8) for p, trained in pieces])
    return tokens, mask


def _write_tokens(files: list[Path], tok, dtype, folder: Path, progress: str):
    """Appends every document's tokens and mask to the folder's files; returns (kind,
    document starts, trained tokens). Raises before returning if nothing can be trained."""
    total_bytes = sum(f.stat().st_size for f in files)
    bar = Progress(total_bytes, progress, label="prepare")
    kind, starts, count, trained = None, [0], 0, 0
    with open(folder / "tokens.bin", "wb") as tokens_file, \
            open(folder / "loss_mask.bin", "wb") as mask_file:
        for record, where, done in _documents(files):
            this = _kind(record, where)
            if kind is None:
                kind = this
            elif this != kind:
                raise ConfigError(f"{where}: a {this} record among {kind} records; prepare "
                                  "text and instruction data into separate folders.")
            tokens, mask = _encode(record, kind, tok, where)
            tokens.astype(dtype).tofile(tokens_file)
            mask.tofile(mask_file)
            count += len(tokens)
            trained += int(mask.sum())
            starts.append(count)
            if len(starts) % 256 == 0 or done == total_bytes:
                bar.update(done, {"documents": len(starts) - 1, "tokens": count})
    bar.close()
    if count == 0:
        raise ConfigError(f"prepare: {', '.join(map(str, files[:3]))} hold no text.")
    if kind == "sft" and trained == 0:
        raise ConfigError("prepare: no instruction example has a response to train on.")
    if kind == "text":
        (folder / "loss_mask.bin").unlink()  # every token counts
    return kind, starts, trained


def prepare(inputs: list[str], out_dir: str | Path, tokenizer: str = "bytes",
            progress: str = "auto") -> dict:
    """Tokenizes `inputs` (paths or glob patterns) into `out_dir`; returns its meta.json."""
    files = sorted({Path(p) for pattern in inputs for p in (glob.glob(pattern) or [pattern])})
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"prepare: no such input file: {', '.join(missing[:5])}.")
    out = Path(out_dir)
    if out.exists():
        raise ConfigError(f"prepare: {out} already exists; write into a new folder.")
    tok = load_tokenizer(tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    try:
        kind, starts, trained = _write_tokens(files, tok, dtype, tmp, progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written folder is left behind
        raise
    count = starts[-1]
    np.save(tmp / "documents.npy", np.asarray(starts, np.int64))
    meta = {"format": META, "kind": kind, "dtype": np.dtype(dtype).name, "tokens": count,
            "documents": len(starts) - 1, "trained_tokens": trained,
            "vocab_size": tok.vocab_size, "tokenizer": tok.name, "bos_id": tok.bos_id,
            "eos_id": tok.eos_id, "inputs": [str(f) for f in files]}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    tmp.rename(out)
    return meta
