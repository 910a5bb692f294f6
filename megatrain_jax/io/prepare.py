"""`megatrain-jax prepare`: text files or JSONL into a folder of token memmaps.

    prepare(["books/*.txt"], "data/books")                            # byte-level tokens
    prepare(["chat.jsonl"], "data/chat", tokenizer="Llama-3.1-8B/")   # tokenizer.json

Inputs are read one document at a time and their tokens appended to the output files, so a
dataset larger than memory is fine (a `.json` file, an array of records, is read whole).
What a line of JSONL holds decides the kind of data:

    {"text": "..."}                                   text: every token is trained on
    {"prompt": "...", "response": "..."}              instruction: loss on the response only
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}

A plain text file is one text document; a text document ends with the tokenizer's
end-of-text token (never a chat marker such as `<|im_end|>`). Instruction examples get a
per-token loss mask (1 on the assistant's tokens and the end-of-sequence token). Chat messages
are rendered with the tokenizer's chat template when it has one, as transformers'
`apply_chat_template` renders and tokenizes them (chat_template.py), else as "role: content"
lines; the progress output says which.

Nothing is read inexactly: a file that is not UTF-8 is refused, naming the byte (or with
`errors="replace"`, such bytes become U+FFFD), and a record whose fields are not strings is
refused naming its `file:line` and the field.

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
from megatrain_jax.io.chat_template import compile_chat_template
from megatrain_jax.io.data import META
from megatrain_jax.io.progress import Progress
from megatrain_jax.io.tokenizer import load_tokenizer


def _decode(data: bytes, where: str, errors: str, start: int = 0, json_line: bool = False):
    """`data` as UTF-8; a byte that is not is an error naming its offset in the file (`data`
    begins at `start`) and, in a line of JSON, the field that holds it, unless `errors` is
    "replace"."""
    try:
        return data.decode("utf-8", errors="replace" if errors == "replace" else "strict")
    except UnicodeDecodeError as e:
        field = _undecodable_field(data) if json_line else None
        what = f"field '{field}' is" if field else "it is"
        raise ConfigError(f"{where}: {what} not UTF-8 at byte {start + e.start} of the file "
                          f"({e.reason}); convert it to UTF-8, or pass --errors replace to read "
                          "such bytes as U+FFFD.") from None


def _undecodable_field(line: bytes) -> str | None:
    """The field of a line of JSON whose string holds a byte that is not UTF-8, where the
    line parses."""
    try:
        record = json.loads(line.decode("utf-8", "surrogateescape"))
    except ValueError:
        return None

    def find(value, path: str) -> str | None:
        if isinstance(value, str):
            return path if any("\udc80" <= c <= "\udcff" for c in value) else None
        items = value.items() if isinstance(value, dict) else \
            enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            found = find(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
            if found:
                return found
        return None

    found = find(record, "")
    return found.lstrip(".") if found else None


def _documents(files: list[Path], errors: str = "strict"):
    """Yields (record, where, bytes read so far) for every document of every input file."""
    done = 0
    for file in files:
        if file.suffix == ".json":  # one JSON array of records
            try:
                records = json.loads(_decode(file.read_bytes(), str(file), errors))
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
                    where = f"{file}:{number}"
                    text = _decode(line, where, errors, done, json_line=True)
                    done += len(line)
                    if not text.strip():
                        continue
                    try:
                        record = json.loads(text)
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"{file}:{number} is not valid JSON: {e}") from e
                    if not isinstance(record, dict):
                        raise ConfigError(f"{file}:{number}: expected a JSON object per line.")
                    yield record, where, done
        else:
            text = _decode(file.read_bytes(), str(file), errors)
            done += file.stat().st_size
            yield {"text": text}, str(file), done


def _kind(record: dict, where: str) -> str:
    if "text" in record:
        return "text"
    if "messages" in record or ("prompt" in record and "response" in record):
        return "sft"
    raise ConfigError(f"{where}: a record needs 'text', 'prompt' and 'response', or "
                      f"'messages'; it has {sorted(record)}.")


def _string_fields(record: dict, kind: str, where: str) -> None:
    """Refuses a record whose text fields are not strings, naming the field."""
    if kind == "text":
        fields = {"text": record["text"]}
    elif "prompt" in record:
        fields = {"prompt": record["prompt"], "response": record["response"]}
    else:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ConfigError(f"{where}: field 'messages' must be a list of {{'role', "
                              "'content'}} objects.")
        fields = {f"messages[{i}].{key}": m[key] for i, m in enumerate(messages)
                  for key in ("role", "content")}
    for name, value in fields.items():
        if not isinstance(value, str):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise ConfigError(f"{where}: field '{name}' must be a string, not {shown}.")


def _plain_chat(messages: list[dict], special: dict) -> str:
    return "".join(f"{m['role']}: {m['content']}\n\n" for m in messages)


def _spans(record: dict, tokenizer, where: str) -> list[tuple[str, bool]]:
    """(text, trained on) pieces of an instruction example, in order."""
    if "prompt" in record:
        return [(record["prompt"], False), (record["response"], True)]
    messages = record["messages"]
    render = _plain_chat
    if tokenizer.chat_template:
        if getattr(tokenizer, "render", None) is None:
            tokenizer.render = compile_chat_template(tokenizer.chat_template)
        render = tokenizer.render
    # Each message's text is what rendering it adds to the conversation before it.
    pieces, before = [], ""
    special = getattr(tokenizer, "special", {})
    for k, message in enumerate(messages):
        try:
            text = render(messages[:k + 1], special)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        if not text.startswith(before):
            raise ConfigError(f"{where}: the chat template does not render messages "
                              "incrementally; use prompt/response records.")
        pieces.append((text[len(before):], message["role"] == "assistant"))
        before = text
    return pieces


def _encode_pieces(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[np.ndarray, np.ndarray]:
    """The ids of the pieces' text as one (as apply_chat_template tokenizes a conversation),
    and a mask of the tokens that begin inside a trained piece. A tokenizer without offsets
    (bytes) encodes piece by piece, which is the same for it."""
    if not hasattr(tokenizer, "encode_with_offsets"):
        ids = [tokenizer.encode(text) for text, _ in pieces]
        mask = [np.full(len(i), trained, np.uint8) for i, (_, trained) in zip(ids, pieces)]
        return np.concatenate(ids).astype(np.int64), np.concatenate(mask)
    ids, offsets = tokenizer.encode_with_offsets("".join(text for text, _ in pieces))
    trained_ends, end = [], 0
    for text, trained in pieces:
        trained_ends.append((end, end + len(text), trained))
        end += len(text)
    mask = np.asarray([any(lo <= start < hi for lo, hi, t in trained_ends if t)
                       for start, _ in offsets], np.uint8)
    return ids, mask


def _encode(record: dict, kind: str, tokenizer, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A document's tokens and its loss mask (ones for text)."""
    bos = getattr(tokenizer, "document_bos_id", tokenizer.bos_id)
    bos = [bos] if bos is not None else []
    if kind == "text":
        end = getattr(tokenizer, "end_of_text_id", tokenizer.eos_id)
        end = [end] if end is not None else []
        tokens = np.concatenate([bos, tokenizer.encode(record["text"]), end]).astype(np.int64)
        return tokens, np.ones(len(tokens), np.uint8)
    if "messages" in record:  # the template (or the plain lines) as the whole example
        tokens, mask = _encode_pieces(tokenizer, _spans(record, tokenizer, where))
        if tokenizer.chat_template:
            return tokens, mask
        tokens, mask = [tokens], [mask]
    else:
        tokens = [tokenizer.encode(text) for text, _ in _spans(record, tokenizer, where)]
        mask = [np.zeros(len(tokens[0]), np.uint8), np.ones(len(tokens[1]), np.uint8)]
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    tokens = np.concatenate([bos, *tokens, eos]).astype(np.int64)
    mask = np.concatenate([np.zeros(len(bos), np.uint8), *mask, np.ones(len(eos), np.uint8)])
    return tokens, mask


def _write_tokens(files: list[Path], tok, dtype, folder: Path, progress: str,
                  errors: str = "strict"):
    """Appends every document's tokens and mask to the folder's files; returns (kind,
    document starts, trained tokens). Raises before returning if nothing can be trained."""
    total_bytes = sum(f.stat().st_size for f in files)
    bar = Progress(total_bytes, progress, label="prepare")
    if hasattr(tok, "describe"):
        bar.note(tok.describe())
    kind, starts, count, trained = None, [0], 0, 0
    with open(folder / "tokens.bin", "wb") as tokens_file, \
            open(folder / "loss_mask.bin", "wb") as mask_file:
        for record, where, done in _documents(files, errors):
            this = _kind(record, where)
            if kind is None:
                kind = this
            elif this != kind:
                raise ConfigError(f"{where}: a {this} record among {kind} records; prepare "
                                  "text and instruction data into separate folders.")
            _string_fields(record, kind, where)
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
            progress: str = "auto", errors: str = "strict") -> dict:
    """Tokenizes `inputs` (paths or glob patterns) into `out_dir`; returns its meta.json.
    `errors="replace"` reads bytes that are not UTF-8 as U+FFFD instead of refusing them."""
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
        kind, starts, trained = _write_tokens(files, tok, dtype, tmp, progress, errors)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written folder is left behind
        raise
    count = starts[-1]
    np.save(tmp / "documents.npy", np.asarray(starts, np.int64))
    meta = {"format": META, "kind": kind, "dtype": np.dtype(dtype).name, "tokens": count,
            "documents": len(starts) - 1, "trained_tokens": trained,
            "vocab_size": tok.vocab_size, "tokenizer": tok.name, "bos_id": tok.bos_id,
            "eos_id": tok.eos_id, "end_of_text_id": getattr(tok, "end_of_text_id", None),
            "chat_template": tok.template_source if tok.chat_template else None,
            "inputs": [str(f.resolve()) for f in files]}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    tmp.rename(out)
    return meta
