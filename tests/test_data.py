"""Data: `prepare`, text windows, instruction packing and masks, validation split, errors."""

import json

import jax
import numpy as np
import pytest

from megatrain_jax.cli import main
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.io.data import TokenSource
from megatrain_jax.io.prepare import prepare
from megatrain_jax.train import StreamTrainer, train
from megatrain_jax.train.reference import ReferenceTrainer

PAIRS = [{"prompt": f"Q{i}: what is {i}+{i}?\n", "response": f"A: {2 * i}."} for i in range(40)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def config(source, *more):
    return load_config("tiny", [f"data.source={source}", "data.seq_len=64",
                                "data.batch_size=4", "loop.progress=none", *more])


@pytest.fixture
def sft_folder(tmp_path):
    prepare([str(write_jsonl(tmp_path / "pairs.jsonl", PAIRS))], tmp_path / "sft",
            progress="none")
    return tmp_path / "sft"


def test_prepare_text_files_with_bytes(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world\n" * 20)
    (tmp_path / "b.txt").write_text("second file " * 10)
    assert main(["prepare", str(tmp_path / "*.txt"), "--out", str(tmp_path / "text"),
                 "--progress", "plain"]) == 0
    captured = capsys.readouterr()
    assert "text data, 2 documents" in captured.out
    # Without a terminal the progress bar is plain lines: bytes read, documents, tokens.
    assert "prepare 360/360  documents 2  tokens 360" in captured.err
    meta = json.loads((tmp_path / "text" / "meta.json").read_text())
    tokens = np.memmap(tmp_path / "text" / "tokens.bin", dtype=meta["dtype"], mode="r")
    assert bytes(tokens.astype(np.uint8)).decode() == "hello world\n" * 20 + "second file " * 10
    assert np.load(tmp_path / "text" / "documents.npy").tolist() == [0, 240, 360]
    batch = TokenSource(config(tmp_path / "text")).batch_at(3)
    assert batch["inputs"].shape == (4, 64) and batch["mask"].all()
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


def test_prepare_with_a_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = ["<s>", "</s>", "hello", "world", "again", "[UNK]"]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": "hello world"}, {"text": "again x"}])
    meta = prepare([str(docs)], tmp_path / "out", tokenizer=str(tmp_path), progress="none")
    tokens = np.memmap(tmp_path / "out" / "tokens.bin", dtype=meta["dtype"], mode="r")
    assert tokens.tolist() == [0, 2, 3, 1, 0, 4, 5, 1]
    assert (meta["bos_id"], meta["eos_id"], meta["vocab_size"]) == (0, 1, 6)


def test_instruction_packing_masks_segments_positions(sft_folder):
    meta = json.loads((sft_folder / "meta.json").read_text())
    assert meta["kind"] == "sft" and meta["documents"] == 40
    data = TokenSource(config(sft_folder))
    tokens = np.memmap(sft_folder / "tokens.bin", dtype=meta["dtype"], mode="r")
    loss_mask = np.memmap(sft_folder / "loss_mask.bin", dtype=np.uint8, mode="r")
    starts = np.load(sft_folder / "documents.npy")
    batch = data.batch_at(0)
    seg, pos, mask = batch["segment_ids"], batch["positions"], batch["mask"]
    assert seg.max() >= 2  # examples were packed together
    for b in range(4):
        for s in range(1, seg[b].max() + 1):
            where = np.flatnonzero(seg[b] == s)
            assert (pos[b, where] == np.arange(len(where))).all()
            # Find which example this is, and check its tokens and trained targets.
            text = batch["inputs"][b, where]
            k = next(k for k in range(40) if np.array_equal(
                tokens[starts[k]:starts[k] + len(where)], text))
            expected = loss_mask[starts[k] + 1:starts[k + 1]]
            np.testing.assert_array_equal(mask[b, where][:len(expected)], expected)
            assert mask[b, where][len(expected):].sum() == 0  # its last input predicts nothing
            prompt = len(PAIRS[k]["prompt"])
            assert mask[b, where][:prompt - 1].sum() == 0  # no loss on the prompt
            assert mask[b, where][prompt - 1:-1].all()  # the response, whole
    assert mask[seg == 0].sum() == 0  # padding


def test_instruction_order_is_deterministic_by_seed_and_covers_every_example(sft_folder):
    def rows(seed):
        data = TokenSource(config(sft_folder, f"data.seed={seed}"))
        return [data.batch_at(step)["inputs"] for step in range(6)]

    a, b, c = rows(0), rows(0), rows(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    data = TokenSource(config(sft_folder))
    data.batch_at(0)
    first_epoch = data._epochs[0]
    assert sorted(k for row in first_epoch for k in row) == list(range(40))


def test_a_json_array_is_the_same_data_as_jsonl(tmp_path):
    (tmp_path / "pairs.json").write_text(json.dumps(PAIRS[:5]))
    write_jsonl(tmp_path / "pairs.jsonl", PAIRS[:5])
    prepare([str(tmp_path / "pairs.json")], tmp_path / "a", progress="none")
    prepare([str(tmp_path / "pairs.jsonl")], tmp_path / "b", progress="none")
    for name in ("tokens.bin", "loss_mask.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_chat_messages_train_on_assistant_turns_only(tmp_path):
    chats = [{"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello!"},
                           {"role": "user", "content": "bye"},
                           {"role": "assistant", "content": "ciao"}]}]
    meta = prepare([str(write_jsonl(tmp_path / "c.jsonl", chats))], tmp_path / "c",
                   progress="none")
    tokens = np.memmap(tmp_path / "c" / "tokens.bin", dtype=meta["dtype"], mode="r")
    mask = np.memmap(tmp_path / "c" / "loss_mask.bin", dtype=np.uint8, mode="r")
    text = bytes(tokens.astype(np.uint8)).decode()
    trained = bytes(tokens[mask == 1].astype(np.uint8)).decode()
    assert text == "user: hi\n\nassistant: hello!\n\nuser: bye\n\nassistant: ciao\n\n"
    assert trained == "assistant: hello!\n\nassistant: ciao\n\n"


def test_packed_batch_trains_the_same_in_both_trainers(sft_folder):
    cfg = config(sft_folder, "model.compute_dtype=float32", "model.attention=xla")
    batch = TokenSource(cfg).batch_at(1)
    stream, reference = StreamTrainer(cfg), ReferenceTrainer(cfg)
    key = jax.random.key(0)
    s_state, r_state = stream.init(key), reference.init(key)
    for _ in range(2):
        s_state, s_metrics = stream.train_step(s_state, batch)
        r_state, r_metrics = reference.train_step(r_state, batch)
        np.testing.assert_allclose(float(s_metrics["loss"]), float(r_metrics["loss"]),
                                   rtol=1e-5)
    np.testing.assert_allclose(float(stream.eval_loss(s_state, batch)),
                               float(reference.eval_loss(r_state, batch)), rtol=1e-5)


def test_packing_keeps_examples_apart():
    """The loss of a packed row is the sum of its examples' losses computed alone."""
    from megatrain_jax import model

    cfg = load_config("tiny", ["model.compute_dtype=float32", "model.attention=xla"])
    params = model.init(cfg.model, jax.random.key(0))
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 9), rng.integers(0, 256, 7)

    def loss(tokens, mask, seg=None, pos=None):
        batch = {"inputs": tokens[None, :-1], "targets": tokens[None, 1:],
                 "mask": mask[None].astype(np.float32)}
        if seg is not None:
            batch.update(segment_ids=seg[None], positions=pos[None])
        return float(jax.jit(model.loss, static_argnums=2)(params, batch, cfg.model, 1.0))

    packed = np.concatenate([a, b])
    seg = np.array([1] * 9 + [2] * 6)
    pos = np.concatenate([np.arange(9), np.arange(6)])
    mask = np.array([1] * 8 + [0] + [1] * 6)
    together = loss(packed, mask, seg, pos)
    apart = loss(a, np.ones(8)) + loss(b, np.ones(6))
    np.testing.assert_allclose(together, apart, rtol=1e-5)


def test_validation_split_and_eval_loss_in_a_run(tmp_path):
    cfg = load_config("tiny", ["data.val_fraction=0.1", "loop.eval_every=2", "loop.steps=4",
                               "loop.eval_batches=2", f"loop.run_dir={tmp_path}",
                               "loop.progress=none"])
    train_part, val_part = TokenSource(cfg).tokens, TokenSource(cfg, "val").tokens
    total = len(TokenSource(load_config("tiny")).tokens)
    assert len(train_part) + len(val_part) == total and len(val_part) == int(total * 0.1)
    assert np.array_equal(TokenSource(cfg, "val").batch_at(0)["inputs"],
                          TokenSource(cfg, "val").batch_at(0)["inputs"])
    train(cfg)
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(np.isfinite(e["loss"]) and e["loss"] > 0 for e in evals)


def test_sft_validation_holds_out_whole_examples(sft_folder):
    cfg = config(sft_folder, "data.val_fraction=0.25")
    train_ids = {int(s) for s, _ in TokenSource(cfg).examples}
    val_ids = {int(s) for s, _ in TokenSource(cfg, "val").examples}
    assert len(val_ids) == 10 and len(train_ids) == 30 and not train_ids & val_ids


def test_data_errors_before_training(tmp_path, sft_folder):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([1, 2, 300, 4] * 100, np.int32))
    with pytest.raises(ConfigError, match="token id 300, outside the vocabulary of "
                                          "model.vocab_size=256"):
        TokenSource(config(ids))
    np.save(ids, np.zeros(0, np.int32))
    with pytest.raises(ConfigError, match="holds no tokens"):
        TokenSource(config(ids))
    np.save(ids, np.ones(20, np.int32))
    with pytest.raises(ConfigError, match="20 tokens, fewer than one sequence of "
                                          "data.seq_len \\+ 1 = 65"):
        TokenSource(config(ids))
    np.save(ids, np.ones(40, np.int32))
    with pytest.raises(ConfigError, match="of its val split"):
        TokenSource(config(ids, "data.val_fraction=0.5"), "val")
    with pytest.raises(ConfigError, match="no such file or folder"):
        TokenSource(config(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="needs a validation split"):
        config(ids, "loop.eval_every=5")
    with pytest.raises(ConfigError, match="no response token"):
        TokenSource(config(sft_folder, "data.seq_len=4", "model.max_seq_len=64"))

    meta = json.loads((sft_folder / "meta.json").read_text())
    (sft_folder / "meta.json").write_text(json.dumps({**meta, "vocab_size": 1000}))
    TokenSource(config(sft_folder))  # a larger tokenizer is fine while its ids fit
    with pytest.raises(ConfigError, match="outside the vocabulary of model.vocab_size=64 "
                                          "\\(tokenizer bytes\\)"):
        TokenSource(config(sft_folder, "model.vocab_size=64"))

    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="hold no text"):
        prepare([str(tmp_path / "empty.txt")], tmp_path / "e", progress="none")
    assert not (tmp_path / "e").exists() and not (tmp_path / "e.partial").exists()
    mixed = write_jsonl(tmp_path / "m.jsonl", [{"text": "a"}, PAIRS[0]])
    with pytest.raises(ConfigError, match="m.jsonl:2: a sft record among text records"):
        prepare([str(mixed)], tmp_path / "m", progress="none")
    assert not (tmp_path / "m.partial").exists()  # an error leaves no half-written folder
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2 is not valid JSON"):
        prepare([str(tmp_path / "bad.jsonl")], tmp_path / "b", progress="none")
    with pytest.raises(ConfigError, match="a record needs 'text'"):
        prepare([str(write_jsonl(tmp_path / "o.jsonl", [{"other": 1}]))], tmp_path / "o",
                progress="none")
    with pytest.raises(ConfigError, match="already exists"):
        prepare([str(mixed)], sft_folder, progress="none")
