"""Runs that survive their schedulers and their neighbours: the run lock, the clean stop on
SIGTERM and SIGINT, every setting checked before anything is written, requeue-friendly exits,
and `prepare` reading its inputs exactly."""

import json
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import typing

import numpy as np
import pytest
from conftest import process_env, tiny

from megatrain_jax.cli import main
from megatrain_jax.config import Config, ConfigError, load_config
from megatrain_jax.config.load import _dotted_keys
from megatrain_jax.config.ranges import RANGES
from megatrain_jax.io import array_files
from megatrain_jax.io.checkpoint import complete_steps
from megatrain_jax.io.run_folder import RunFolderInUse, RunLock
from megatrain_jax.train import loop as train_loop
from megatrain_jax.train import train
from megatrain_jax.train.resume import check_continues

SETTINGS = ("model.compute_dtype=float32", "loop.progress=none", "loop.tensorboard=off",
            "loop.timeline_step=-1", "loop.steps=8", "loop.checkpoint_every=4")


def _args(run_dir, *more) -> list[str]:
    return [*SETTINGS, f"loop.run_dir={run_dir}", *more]


def _losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl")
                                              .read_text().splitlines())}


def _checksums(run_dir, step) -> dict:
    manifest = json.loads((run_dir / "checkpoints" / str(step) / "manifest.json").read_text())
    return {a["key"]: [shard["checksum"] for shard in a["shards"]] for a in manifest["arrays"]}


def _last_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.strip()][-1]


@pytest.fixture(autouse=True)
def pool_env(monkeypatch):
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "8")


@pytest.fixture(scope="module")
def lone(tmp_path_factory):
    """An unbroken 8-step run with a metrics line per step, checkpoints at 4 and 8."""
    run = tmp_path_factory.mktemp("lone") / "run"
    train(tiny(*_args(run, "loop.log_every=1")))
    return run


# ----- the run lock ------------------------------------------------------------------------------

def test_a_second_train_on_a_held_folder_exits_2_naming_the_holder_and_the_first_is_intact(
        lone, tmp_path, monkeypatch):
    run = tmp_path / "run"
    paused, go = threading.Event(), threading.Event()
    batch_at = train_loop.TokenSource.batch_at

    def pausing(self, step):
        if step == 5:  # the first run holds the folder, with checkpoint 4 written
            paused.set()
            go.wait(timeout=300)
        return batch_at(self, step)

    monkeypatch.setattr(train_loop.TokenSource, "batch_at", pausing)
    ended = []
    first = threading.Thread(target=lambda: ended.append(
        train(tiny(*_args(run, "loop.log_every=1")))["last_loss"]))
    first.start()
    try:
        assert paused.wait(timeout=300)
        second = subprocess.run(
            [sys.executable, "-m", "megatrain_jax.cli", "train", "tiny",
             *_args(run, "loop.steps=40", "optim.lr=0.002", "loop.accept_changes=true")],
            env=process_env(), capture_output=True, text=True, timeout=300)
    finally:
        go.set()
        first.join()
    assert second.returncode == 2, second.stderr
    assert ended == [_losses(lone)[8]]  # the first run went on to its end
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith("megatrain-jax: config error: loop.run_dir ")
    assert f"is in use by another train (pid {os.getpid()} on host " in line
    # The first run, finished, holds what a lone run holds.
    assert complete_steps(run / "checkpoints") == [4, 8]
    for step in (4, 8):
        assert _checksums(run, step) == _checksums(lone, step)
    assert _losses(run) == _losses(lone)
    saved, alone = (json.loads((r / "config.json").read_text()) for r in (run, lone))
    assert saved["loop"].pop("run_dir") == str(run) and alone["loop"].pop("run_dir")
    assert saved == alone


HOLDER = """
import sys, threading
from megatrain_jax.io.run_folder import RunLock
lock = RunLock(sys.argv[1])
lock.hold()
print("held", flush=True)
threading.Event().wait()
"""


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              env=process_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderInUse, match=f"in use by another train \\(pid {holder.pid} "):
            RunLock(tmp_path).hold()
    finally:
        holder.kill()  # SIGKILL: no handler runs, nothing is cleaned up
        holder.wait()
    with RunLock(tmp_path) as lock:  # the system released it with the process
        assert lock.held
    assert (tmp_path / "run.lock").read_text().startswith(f"pid {os.getpid()} on host ")


# ----- the clean stop ----------------------------------------------------------------------------

def _events(folder) -> list[list]:
    """The events of each TensorBoard file in `folder`, the files in the order written."""
    from tensorboardX.proto import event_pb2

    files = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at, events = path.read_bytes(), 0, []
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[at + 12:at + 12 + length])
            events.append(event)
            at += 16 + length
        files.append(events)
    return files


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_mid_step_saves_that_step_and_the_rerun_continues_bit_for_bit(
        signum, lone, tmp_path, monkeypatch, capsys):
    run, sent = tmp_path / "run", []
    batch_at = train_loop.TokenSource.batch_at
    args = ["train", "tiny", *_args(run, "loop.log_every=100", "loop.tensorboard=on")]

    def signalling(self, step):
        if step == 2 and not sent:  # as step 3 begins
            sent.append(os.kill(os.getpid(), signum))
        return batch_at(self, step)

    monkeypatch.setattr(train_loop.TokenSource, "batch_at", signalling)
    assert main(args) == 128 + signum
    name = signal.Signals(signum).name
    assert _last_line(capsys) == (f"megatrain-jax: stopped by {name} at step 3 of 8: checkpoint "
                                  f"3 is complete in {run / 'checkpoints'}; run the same command "
                                  "to resume.")
    assert complete_steps(run / "checkpoints") == [3]
    assert not list((run / "checkpoints").glob("*.partial"))
    assert sorted(_losses(run)) == [1, 3]  # the first line, and the stopped step's
    assert signal.getsignal(signum) is not None  # the handlers given back
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    straight, resumed = _losses(lone), _losses(run)
    assert sorted(resumed) == [1, 3, 4, 8]
    assert all(resumed[s] == straight[s] for s in resumed)  # bit for bit
    assert _checksums(run, 8) == _checksums(lone, 8)
    assert summary["first_loss"] == straight[1]  # the run's first step, not the resumed one's
    # The rerun's events start by purging the steps after the checkpoint it resumed from.
    first, second = _events(run / "tensorboard")
    assert {e.step for e in first if e.summary.value} == {1, 3}
    start = [e.step for e in second if e.session_log.status == e.session_log.START]
    assert start == [4] and min(e.step for e in second if e.summary.value) == 4


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_mid_save_ends_at_a_complete_checkpoint_and_the_rerun_continues_bit_for_bit(
        signum, lone, tmp_path, monkeypatch, capsys):
    run, sent = tmp_path / "run", []
    write_array = array_files.write_array
    args = ["train", "tiny", *_args(run, "loop.log_every=100")]

    def signalling(path, data, dtype):
        if path.parent.name == "4.partial" and not sent:  # checkpoint 4 is being written
            sent.append(os.kill(os.getpid(), signum))
        return write_array(path, data, dtype)

    monkeypatch.setattr(array_files, "write_array", signalling)
    assert main(args) == 128 + signum
    line = _last_line(capsys)
    # The save under way completes and the run stops at its step, or (were it done when the
    # step in flight ended) the step just ended is saved.
    stopped = complete_steps(run / "checkpoints")[-1]
    assert stopped in (4, 5, 6)
    assert line.startswith(f"megatrain-jax: stopped by {signal.Signals(signum).name} at step "
                           f"{stopped} of 8")
    assert line.endswith(f"checkpoint {stopped} is complete in {run / 'checkpoints'}; run the "
                         "same command to resume.")
    assert not list((run / "checkpoints").glob("*.partial"))
    assert max(_losses(run)) == stopped  # metrics.jsonl ends at the stopped step
    assert main(args) == 0
    resumed, straight = _losses(run), _losses(lone)
    assert stopped + 1 in resumed and all(resumed[s] == straight[s] for s in resumed)
    assert _checksums(run, 8) == _checksums(lone, 8)


def test_stop_save_false_stops_without_a_checkpoint_of_the_step(tmp_path, monkeypatch, capsys):
    run, batch_at = tmp_path / "run", train_loop.TokenSource.batch_at

    def signalling(self, step):
        if step == 5:  # as step 6 begins; checkpoint 4 is written
            os.kill(os.getpid(), signal.SIGTERM)
        return batch_at(self, step)

    monkeypatch.setattr(train_loop.TokenSource, "batch_at", signalling)
    assert main(["train", "tiny", *_args(run, "loop.stop_save=false")]) == 143
    assert _last_line(capsys) == (
        "megatrain-jax: stopped by SIGTERM at step 6 of 8: no checkpoint of it "
        "(loop.stop_save=false); run the same command to resume from checkpoint 4 in "
        f"{run / 'checkpoints'}.")
    assert complete_steps(run / "checkpoints") == [4] and max(_losses(run)) == 6


SAVE_HANGS = """
import sys, threading
from megatrain_jax import cli
from megatrain_jax.io import array_files
write_array = array_files.write_array
def hanging(path, data, dtype):
    if path.parent.name == "4.partial":
        threading.Event().wait()  # checkpoint 4 never completes
    return write_array(path, data, dtype)
array_files.write_array = hanging
sys.exit(cli.main(sys.argv[1:]))
"""


def _wait_for(path, process, text: str | None = None, limit: float = 120.0) -> None:
    """Returns once `path` exists (and holds `text`); fails if `process` ends first."""
    begun = time.monotonic()
    while not path.exists() or (text is not None and text not in path.read_text()):
        assert process.poll() is None, f"the process ended first ({process.returncode})"
        assert time.monotonic() - begun < limit, f"{path} did not appear"
        time.sleep(0.05)


def test_a_second_signal_stops_at_once_leaving_only_complete_checkpoints(tmp_path):
    run = tmp_path / "run"
    args = _args(run, "loop.checkpoint_every=2")
    with open(tmp_path / "stderr", "w") as errors:
        process = subprocess.Popen([sys.executable, "-c", SAVE_HANGS, "train", "tiny", *args],
                                   env=process_env(), stdout=subprocess.DEVNULL,
                                   stderr=errors)
    try:
        _wait_for(run / "checkpoints" / "4.partial", process)  # checkpoint 2 is complete
        process.send_signal(signal.SIGTERM)
        _wait_for(tmp_path / "stderr", process, "send it again to stop at once")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM  # ended by the signal itself
    finally:
        process.kill()
        process.wait()
    assert complete_steps(run / "checkpoints") == [2]  # 4.partial is never read
    started = []
    train(tiny(*args), on_start=started.append)
    assert started == [2]


# ----- settings out of range ---------------------------------------------------------------------

OUT_OF_RANGE = {
    "optim.b1=1.5": "optim.b1 (1.5) must be within [0, 1).",
    "optim.b2=-1": "optim.b2 (-1.0) must be within [0, 1).",
    "optim.eps=-1": "optim.eps (-1.0) must be > 0.",
    "optim.weight_decay=-5": "optim.weight_decay (-5.0) must be >= 0.",
    "schedule.warmup_steps=-1": "schedule.warmup_steps (-1) must be >= 0.",
    "schedule.decay_steps=-3": "schedule.decay_steps (-3) must be >= 0 (0: until loop.steps).",
    "model.init_std=-1": "model.init_std (-1.0) must be > 0.",
    "loop.log_every=-1": "loop.log_every (-1) must be >= 1.",
    "loop.log_every=0": "loop.log_every (0) must be >= 1.",
    "model.heads=0": "model.heads (0) must be >= 1.",
    "model.head_dim=-4": "model.head_dim (-4) must be >= 0 (0: model.hidden / model.heads).",
    "model.norm_eps=0": "model.norm_eps (0.0) must be > 0.",
    "optim.momentum=1": "optim.momentum (1.0) must be within [0, 1).",
    "optim.lr=NaN": "optim.lr (nan) must be > 0.",
    "data.seed=-1": f"data.seed (-1) must be within [0, {2**63}).",
    "stream.host_memory_gb=-1": "stream.host_memory_gb (-1.0) must be >= 0 (0: sized from the "
                                "model).",
    "loop.timeline_step=-2": "loop.timeline_step (-2) must be >= -1 (-1: none).",
}


@pytest.mark.parametrize("override", sorted(OUT_OF_RANGE))
def test_a_setting_out_of_range_is_one_line_and_exit_2_with_nothing_written(override, tmp_path,
                                                                          capsys):
    run = tmp_path / "run"
    assert main(["train", "tiny", f"loop.run_dir={run}", override]) == 2
    assert _last_line(capsys) == f"megatrain-jax: config error: {OUT_OF_RANGE[override]}"
    assert not run.exists()


def test_a_refused_setting_leaves_an_existing_run_folder_as_it_was(lone, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lone, run)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}
    assert main(["train", "tiny", *_args(run, "optim.b1=1.5")]) == 2
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*")
            if p.is_file()} == before


def test_every_numeric_setting_has_a_range():
    def field_type(key):
        cls, *path, name = [Config, *key.split(".")]
        for part in path:
            cls = typing.get_type_hints(cls)[part]
        return typing.get_type_hints(cls)[name]

    numeric = {k for k in _dotted_keys(Config) if field_type(k) in (int, float)}
    assert numeric == set(RANGES)


# ----- requeues and resumes ----------------------------------------------------------------------

def test_a_finished_run_exits_0_saying_so_and_fewer_steps_than_its_checkpoint_exit_2(
        lone, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lone, run)
    before = (run / "metrics.jsonl").read_bytes()
    assert main(["train", "tiny", *_args(run, "loop.log_every=1")]) == 0
    captured = capsys.readouterr()
    assert f"megatrain-jax: {run} is finished: its checkpoint 8 is its last step" in captured.err
    summary = json.loads(captured.out)
    assert summary["steps"] == 8 and summary["last_loss"] == _losses(lone)[8]
    assert (run / "metrics.jsonl").read_bytes() == before
    # The hint is a command that resumes, where raising loop.steps alone would be refused.
    hint = shlex.split(captured.err.split("To train on: ")[1])
    assert hint[:3] == ["megatrain-jax", "train", "tiny"] and hint[-2:] == [
        "loop.steps=16", "schedule.decay_steps=8"]
    folder = run / "checkpoints" / "8"
    meta = json.loads((folder / "manifest.json").read_text())["meta"]
    check_continues(load_config("tiny", hint[3:]), meta, folder)
    with pytest.raises(ConfigError, match="would change the steps its run had planned"):
        check_continues(load_config("tiny", hint[3:-1]), meta, folder)
    assert main(["train", "tiny", *_args(run, "loop.steps=6")]) == 2
    assert _last_line(capsys).startswith(
        f"megatrain-jax: config error: {run / 'checkpoints'} already holds step 8, past "
        "loop.steps=6: set loop.steps to 8 or more to go on from it")


def test_the_learning_rate_refusal_names_the_first_step_to_come(lone):
    folder = lone / "checkpoints" / "4"
    meta = json.loads((folder / "manifest.json").read_text())["meta"]
    with pytest.raises(ConfigError, match=r"the learning rate from step 5 on \(.* there; "
                                          r"optim.lr: 0.001 -> 0.002\)"):
        check_continues(tiny(*_args(lone, "optim.lr=0.002")), meta, folder)


def test_an_empty_step_folder_is_named_as_such(lone, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lone, run)
    (run / "checkpoints" / "12").mkdir()
    assert main(["train", "tiny", *_args(run, "loop.steps=16")]) == 3
    line = _last_line(capsys)
    assert "holds empty step folders ([12]: not checkpoints" in line and "orbax" not in line


# ----- readers beside a run ----------------------------------------------------------------------

def test_export_and_report_read_only_complete_steps_and_whole_lines(lone, tmp_path, capsys):
    from safetensors.numpy import load_file

    from megatrain_jax.tools.report import read_jsonl

    run = tmp_path / "run"
    shutil.copytree(lone, run)
    shutil.copytree(run / "checkpoints" / "4", run / "checkpoints" / "12.partial")  # being saved
    with open(run / "metrics.jsonl", "a") as metrics:
        metrics.write('{"loss": 3.1, "grad_no')  # a line being written
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, 9))
    assert main(["export", str(run), str(tmp_path / "out"), "--progress", "none"]) == 0
    exported = {}
    for file in (tmp_path / "out").glob("*.safetensors"):
        exported.update(load_file(file))
    stored = np.fromfile(run / "checkpoints" / "8" / "params.embed.table.bin", np.float32)
    np.testing.assert_array_equal(exported["model.embed_tokens.weight"].reshape(-1), stored)


def test_export_needs_only_the_parameters_and_falls_back_on_the_checkpoints_config(
        lone, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lone, run)
    folder = run / "checkpoints" / "8"
    moment = next(p for p in folder.glob("opt_state*.bin"))
    moment.write_bytes(moment.read_bytes()[:-8])  # a damaged optimizer moment
    (run / "config.json").write_text('{"model": {"hidden": 3')  # cut short
    assert main(["export", str(run), str(tmp_path / "out"), "--progress", "none"]) == 0
    err = capsys.readouterr().err
    assert "config.json is not valid JSON" in err and "checkpoint 8 instead" in err
    weight = next(p for p in folder.glob("params*.bin"))
    weight.write_bytes(weight.read_bytes()[:-8])  # a damaged weight
    assert main(["export", str(run), str(tmp_path / "out2"), "--progress", "none"]) == 3
    assert f"checkpoint 8 is damaged: {weight}" in _last_line(capsys)


# ----- prepare reads its inputs exactly ----------------------------------------------------------

def test_prepare_refuses_text_that_is_not_utf8_naming_the_byte_unless_asked_to_replace(
        tmp_path, capsys):
    book = tmp_path / "book.txt"
    book.write_bytes("naïve text, ".encode() + b"\xff\xfe" + b" then more")
    out = tmp_path / "data"
    assert main(["prepare", str(book), "--out", str(out), "--progress", "none"]) == 2
    assert _last_line(capsys) == (f"megatrain-jax: config error: {book}: it is not UTF-8 at byte "
                                  "13 of the file (invalid start byte); convert it to UTF-8, or "
                                  "pass --errors replace to read such bytes as U+FFFD.")
    assert not out.exists() and not (tmp_path / "data.partial").exists()
    assert main(["prepare", str(book), "--out", str(out), "--progress", "none",
                 "--errors", "replace"]) == 0
    tokens = np.memmap(out / "tokens.bin", dtype=np.uint16, mode="r")
    assert bytes(tokens.astype(np.uint8)).decode() == "naïve text, \ufffd\ufffd then more"


PAIR = b'{"prompt": "1+1=", "response": "2"}\n'  # 36 bytes
BAD_LINES = {  # (a good first line, the bad second one, what is said of it)
    "a number for text": (b'{"text": "hi"}\n', b'{"text": 5}',
                          "field 'text' must be a string, not 5."),
    "a null response": (PAIR, b'{"prompt": "q", "response": null}',
                        "field 'response' must be a string, not null."),
    "a byte that is not UTF-8": (PAIR, b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
                                 "field 'messages[0].content' is not UTF-8 at byte 82 of the "
                                 "file (invalid continuation byte)"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_prepare_names_file_line_and_field_of_a_bad_record(case, tmp_path, capsys):
    good, bad, expected = BAD_LINES[case]
    records = tmp_path / "records.jsonl"
    records.write_bytes(good + bad + b"\n")
    assert main(["prepare", str(records), "--out", str(tmp_path / "data"),
                 "--progress", "none"]) == 2
    assert _last_line(capsys).startswith(f"megatrain-jax: config error: {records}:2: {expected}")
    assert not (tmp_path / "data").exists()


# A ChatML template laid out over lines and indented, as the Hub's are: rendered as
# transformers renders it (trim_blocks, lstrip_blocks), the layout leaves no whitespace behind.
CHAT_TEMPLATE = """{% for message in messages %}
  {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are helpful.<|im_end|>
  {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer folder as transformers 5 saves an instruct model's: the
    template in chat_template.jinja, eos_token a chat marker, <|endoftext|> in the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel
                                  .alphabet(), special_tokens=["<|endoftext|>", "<|im_start|>",
                                                               "<|im_end|>"])
    tok.train_from_iterator(["hello world, how are you? Fine, thank you. Café crème."] * 20,
                            trainer)
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return folder


def test_chat_data_gets_the_ids_of_transformers_apply_chat_template(chat_tokenizer, tmp_path,
                                                                    capsys):
    transformers = pytest.importorskip("transformers")
    chat = [{"role": "user", "content": "hello, how are you?"},
            {"role": "assistant", "content": "Fine, café crème! "},
            {"role": "user", "content": "thank you"},
            {"role": "assistant", "content": "hello world"}]
    records = tmp_path / "chat.jsonl"
    records.write_text(json.dumps({"messages": chat}) + "\n")
    meta = main(["prepare", str(records), "--out", str(tmp_path / "chat"), "--tokenizer",
                 str(chat_tokenizer), "--progress", "plain"])
    assert meta == 0
    assert f"chat template from {chat_tokenizer / 'chat_template.jinja'}" in \
        capsys.readouterr().err
    ids = np.memmap(tmp_path / "chat" / "tokens.bin", dtype=np.uint16, mode="r")
    mask = np.memmap(tmp_path / "chat" / "loss_mask.bin", dtype=np.uint8, mode="r")
    hf = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    assert ids.tolist() == list(hf.apply_chat_template(chat, tokenize=True, return_dict=False))
    assert hf.decode(ids[mask == 1]) == ("<|im_start|>assistant\nFine, café crème!<|im_end|>\n"
                                         "<|im_start|>assistant\nhello world<|im_end|>\n")


@pytest.mark.parametrize("template", ["chat_template.jinja", "none"])
def test_text_documents_end_with_the_end_of_text_token_not_a_chat_marker(
        chat_tokenizer, template, tmp_path, monkeypatch):
    """With its template or without it (a folder of tokenizer.json and tokenizer_config.json
    only), an instruct tokenizer's text documents neither start with its bos <|im_start|>
    nor end with its eos <|im_end|>; meta.json's paths hold from any folder."""
    import shutil

    from tokenizers import Tokenizer

    from megatrain_jax.io.prepare import prepare

    folder = tmp_path / "tokenizer"
    shutil.copytree(chat_tokenizer, folder)
    if template == "none":
        (folder / "chat_template.jinja").unlink()
    (tmp_path / "a.txt").write_text("hello world")
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    meta = prepare(["a.txt"], "text", "tokenizer", progress="none")
    ids = np.memmap(tmp_path / "text" / "tokens.bin", dtype=np.uint16, mode="r").tolist()
    tok = Tokenizer.from_file(str(chat_tokenizer / "tokenizer.json"))
    assert ids == tok.encode("hello world").ids + [tok.token_to_id("<|endoftext|>")]
    assert meta["end_of_text_id"] == tok.token_to_id("<|endoftext|>")
    assert meta["tokenizer"] == str((folder / "tokenizer.json").resolve())
    assert meta["inputs"] == [str((tmp_path / "a.txt").resolve())]
    if template != "none":
        assert meta["chat_template"] == str((folder / "chat_template.jinja").resolve())


# ----- what a run keeps with loop.checkpoint_every=0 -------------------------------------------

def test_sigterm_without_checkpoint_every_saves_the_step_and_the_rerun_continues_bit_for_bit(
        lone, tmp_path, monkeypatch, capsys):
    run, batch_at, sent = tmp_path / "run", train_loop.TokenSource.batch_at, []
    args = ["train", "tiny", *_args(run, "loop.checkpoint_every=0", "loop.log_every=1")]

    def signalling(self, step):
        if step == 2 and not sent:  # as step 3 begins
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return batch_at(self, step)

    monkeypatch.setattr(train_loop.TokenSource, "batch_at", signalling)
    assert main(args) == 143
    assert _last_line(capsys).endswith(f"checkpoint 3 is complete in {run / 'checkpoints'}; run "
                                       "the same command to resume.")
    assert main(args) == 0
    resumed, straight = _losses(run), _losses(lone)
    assert sorted(resumed) == list(range(1, 9)) and all(resumed[s] == straight[s] for s in resumed)
    assert complete_steps(run / "checkpoints") == [3, 8]  # the final step kept by default
    assert _checksums(run, 8) == _checksums(lone, 8)


def test_a_finished_run_without_checkpoint_every_exports_and_its_rerun_touches_nothing(
        tmp_path, capsys):
    kept, bare = tmp_path / "kept", tmp_path / "bare"
    assert main(["train", "tiny", *_args(kept, "loop.checkpoint_every=0")]) == 0
    err = capsys.readouterr().err
    assert f"keeps a checkpoint of its last step in {kept / 'checkpoints'}" in err
    assert complete_steps(kept / "checkpoints") == [8]
    assert main(["export", str(kept), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").exists()
    off = ("loop.checkpoint_every=0", "loop.final_checkpoint=false", "loop.stop_save=false")
    assert main(["train", "tiny", *_args(bare, *off)]) == 0
    assert "kept no checkpoint (loop.checkpoint_every=0" in capsys.readouterr().err
    for run, more in ((kept, ("loop.checkpoint_every=0",)), (bare, off)):
        outputs = [p for p in run.rglob("*") if p.is_file() and p.name != "run.lock"]
        before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in outputs}
        assert main(["train", "tiny", *_args(run, *more)]) == 0
        assert f"{run} is finished" in capsys.readouterr().err
        assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in outputs} == before
        assert sorted(p for p in run.rglob("*") if p.is_file() and p.name != "run.lock") == \
            sorted(outputs)
    assert main(["export", str(bare), str(tmp_path / "hf2")]) == 3
    line = _last_line(capsys)
    assert f"{bare} holds no checkpoints folder" in line and "loop.final_checkpoint" in line


def test_the_summary_splits_the_run_time_and_adds_up_to_its_wall_time(lone, tmp_path, capsys):
    summary = json.loads((lone / "summary.json").read_text())
    split = summary["time"]
    parts = ("startup_s", "compile_s", "steps_s", "save_stall_s", "eval_s", "other_s")
    assert all(split[k] >= 0 for k in parts) and split["save_stall_s"] > 0
    assert sum(split[k] for k in parts) == pytest.approx(split["wall_s"], abs=0.01)
    assert split["other_s"] < 0.2 * split["wall_s"]  # nothing large left unaccounted
    step_s = tiny().data.tokens_per_step / summary["step_tokens_per_s"]  # a step's own time
    assert summary["goodput"] == pytest.approx(8 * step_s / split["wall_s"], rel=1e-3)
    # The split is rounded to milliseconds, the goodput is not.
    assert summary["goodput"] == pytest.approx(split["steps_s"] / split["wall_s"],
                                               abs=1e-3 / split["wall_s"])
    assert 0 < summary["goodput"] < 1


def test_deterministic_runs_set_xlas_flag_before_jax_starts(tmp_path, monkeypatch, capsys):
    from megatrain_jax.train import deterministic

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after
    run = tmp_path / "run"
    assert main(["train", "tiny", *_args(run, "loop.deterministic=true", "loop.steps=2",
                                         "loop.checkpoint_every=0")]) == 0
    flags = os.environ["XLA_FLAGS"].split()
    assert flags.count(deterministic.FLAG) == 1
    deterministic.set_env()  # once only
    assert os.environ["XLA_FLAGS"].split().count(deterministic.FLAG) == 1


def test_a_slow_start_is_explained_with_its_pinned_bytes_and_rate(tmp_path, monkeypatch, capsys):
    """A state whose building and placing takes long, filling pinned host memory slowly, is
    said once at the start, with the bytes, the rate and the key that shortens it."""
    from megatrain_jax.train import accounting

    assert accounting.startup_note(62.0, 80e9).startswith(
        "building and placing the state took 62 s, 80 GB of it in pinned host memory, which "
        "comes at about 1.5 GB/s when new (about 53 s of it)")
    assert "stream.gpu_budget_gb" in accounting.startup_note(62.0, 80e9)
    assert accounting.startup_note(20.0, 30e9) is None  # quick enough
    assert accounting.startup_note(62.0, 1e9) is None  # pinning is not what took the time
    monkeypatch.setattr(accounting, "SLOW_STARTUP_S", 0.0)
    monkeypatch.setattr(accounting, "NEW_PINNED_GBPS", 1e-9)
    assert main(["train", "tiny", *_args(tmp_path / "run", "loop.steps=1",
                                         "loop.checkpoint_every=0", "stream.resident_layers=0",
                                         "stream.resident_embeddings=off",
                                         "loop.progress=plain")]) == 0
    err = capsys.readouterr().err
    assert err.count("megatrain-jax: building and placing the state took") == 1
