"""Nothing lost, nothing silent: verified checkpoints, runs that stop instead of training on
garbage, resumes that cannot change a run, and errors a user can act on (one line, exit 2)."""

import dataclasses
import errno
import json
import os
import shutil

import jax
import numpy as np
import pytest
from conftest import tiny

from megatrain_jax.cli import main
from megatrain_jax.io import array_files, checkpoint
from megatrain_jax.io.checkpoint import Checkpointer, CheckpointError
from megatrain_jax.io.checksum import Checksum, _scan_numpy
from megatrain_jax.train import loop as train_loop
from megatrain_jax.train import make_trainer, train
from megatrain_jax.train.resume import check_continues

SETTINGS = ("model.compute_dtype=float32", "loop.progress=none", "loop.tensorboard=off",
            "loop.timeline_step=-1", "loop.log_every=1", "loop.checkpoint_every=2")


def _args(run_dir, *more) -> list[str]:
    return [*SETTINGS, f"loop.run_dir={run_dir}", *more]


def _losses(run_dir) -> dict:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records}


def _error_line(capsys, prefix="megatrain-jax: config error: ") -> str:
    """The one line the command printed to stderr (after a header line, if it started)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(prefix), err
    assert sum(line.startswith("megatrain-jax: ") for line in lines) <= 2, err
    return lines[-1]


@pytest.fixture(autouse=True)
def pool_env(monkeypatch):
    """`train` sizes the pinned pool through the environment; keep that to each test."""
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "8")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 4-step run (the learning rate decays until loop.steps) with checkpoints at
    steps 2 and 4, and its summary."""
    run = tmp_path_factory.mktemp("base")
    summary = train(tiny(*_args(run, "loop.steps=4")))
    return run, summary


def _copy(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base[0], run)
    return run


def _target():
    return make_trainer(tiny(*SETTINGS)).abstract_state()


# ----- checkpoints -------------------------------------------------------------------------------

def test_flipped_bytes_are_refused_naming_the_step_and_older_ones_are_kept(base, tmp_path,
                                                                          capsys):
    run = _copy(base, tmp_path)
    folder, config_before = run / "checkpoints", (run / "config.json").read_bytes()
    damaged = max((folder / "4").glob("*.bin"), key=lambda p: p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])  # same size
    damaged.write_bytes(bytes(data))
    assert main(["train", "tiny", *_args(run, "loop.steps=6", "schedule.decay_steps=4")]) == 3
    line = _error_line(capsys, "megatrain-jax: checkpoint error: ")
    assert "checkpoint 4 is damaged" in line and damaged.name in line
    assert "resume from step 2" in line
    assert Checkpointer(folder).steps() == [2, 4]  # nothing deleted
    assert (run / "config.json").read_bytes() == config_before  # a failed start
    tree, meta = Checkpointer(folder).restore(2, _target())
    assert meta["step"] == 2 and int(tree["opt_state"]["embed"][0].count) == 2


def test_a_state_with_nan_is_never_written(base, tmp_path):
    run = _copy(base, tmp_path)
    ckpt = Checkpointer(run / "checkpoints", keep=1)
    tree, meta = ckpt.restore(4, _target())
    wq = tree["params"]["layers"][1].wq
    poisoned = np.array(wq)
    poisoned[3, 5] = np.nan
    tree["params"]["layers"][1] = dataclasses.replace(tree["params"]["layers"][1],
                                                      wq=jax.device_put(poisoned, wq.sharding))
    ckpt.save(6, tree, meta)
    with pytest.raises(CheckpointError, match=r"checkpoint 6 not written: the state holds "
                                              r"non-finite values \(params.layers.1.wq\)"):
        ckpt.wait()
    assert ckpt.steps() == [2, 4]  # keep=1 deleted nothing: no newer checkpoint is complete
    assert not list((run / "checkpoints").glob("*.partial"))
    ckpt.close()


def test_non_finite_steps_stop_the_run_and_keep_the_last_good_checkpoint(base, tmp_path,
                                                                        monkeypatch, capsys):
    run = _copy(base, tmp_path)
    batch_at = train_loop.TokenSource.batch_at

    def poisoned(self, step):
        batch = batch_at(self, step)
        if step >= 4:  # steps 5 on: a NaN in the loss, so the gradients are not finite
            batch["mask"][0, 0] = float("nan")
        return batch

    monkeypatch.setattr(train_loop.TokenSource, "batch_at", poisoned)
    args = _args(run, "loop.steps=10", "schedule.decay_steps=4", "loop.max_skipped_steps=2")
    assert main(["train", "tiny", *args]) == 4
    line = _error_line(capsys, "megatrain-jax: training stopped at step 6: steps 5 to 6 ")
    assert "The latest checkpoint, step 4, holds the state from before them" in line
    assert Checkpointer(run / "checkpoints").steps() == [2, 4]  # step 6 was due, not written
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 6 and last["skipped_steps"] == 2


def test_a_full_disk_ends_the_run_with_one_message_and_keeps_the_last_checkpoint(
        base, tmp_path, monkeypatch, capsys):
    run = _copy(base, tmp_path)

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(array_files, "write_all", full)
    assert main(["train", "tiny", *_args(run, "loop.steps=6", "schedule.decay_steps=4")]) == 3
    line = _error_line(capsys, "megatrain-jax: checkpoint error: cannot write checkpoint 6 ")
    assert "No space left on device" in line and "Earlier checkpoints are untouched ([2, 4])" \
        in line and "free disk space" in line
    folder = run / "checkpoints"
    assert Checkpointer(folder).steps() == [2, 4] and not list(folder.glob("*.partial"))
    tree, meta = Checkpointer(folder).restore(4, _target())
    assert meta["step"] == 4


def test_plan_and_train_check_the_disk_before_training(base, tmp_path, monkeypatch, capsys):
    each = checkpoint.tree_bytes(_target())
    folder = base[0] / "checkpoints"
    assert checkpoint.room_needed(folder, 3, each) == 2 * each  # 2 and 4 are there already
    assert checkpoint.room_needed(folder, 1, each) == each  # a new one before the oldest goes
    monkeypatch.setattr(checkpoint, "free_bytes", lambda directory: each)  # room for one
    run = tmp_path / "run"
    assert main(["plan", "tiny", *_args(run, "loop.keep_checkpoints=1")]) == 0
    out = capsys.readouterr().out
    assert "loop.keep_checkpoints=1 needs" in out and "does NOT fit" in out
    assert main(["train", "tiny", *_args(run, "loop.keep_checkpoints=1")]) == 3
    line = _error_line(capsys, "megatrain-jax: checkpoint error: ")
    assert f"needs {checkpoint.size(2 * each)} free" in line
    assert not run.exists()  # refused before the run started


def test_host_state_is_written_from_its_own_buffer():
    """No host copy of the state: a pinned array is read in place, a device one copied."""
    state = _target()["params"]["layers"][0].wq
    host = jax.device_put(np.ones(state.shape, np.float32), state.sharding)
    view = array_files.host_bytes(host)
    assert view.ctypes.data == host.unsafe_buffer_pointer() and not view.flags.writeable
    device = jax.device_put(np.ones((4, 4), np.float32), jax.devices()[0])
    assert array_files.host_bytes(device).ctypes.data != device.unsafe_buffer_pointer()


def test_the_checksum_sees_any_flip_or_move_and_counts_non_finite_values():
    data = np.random.default_rng(0).standard_normal(1001).astype(np.float32)

    def digest(values, kernel=None, split=None):
        checksum, raw = Checksum(np.float32, kernel), values.view(np.uint8)
        for part in (raw[:split], raw[split:]) if split else (raw,):
            checksum.update(part)
        return checksum.hexdigest(), checksum.nonfinite

    reference = digest(data)
    assert digest(data, _scan_numpy) == reference == digest(data, split=800)  # chunks add up
    flipped = data.copy()
    flipped.view(np.uint8)[2001] ^= 4
    swapped = data.copy()
    swapped[[10, 11, 12, 13]] = data[[12, 13, 10, 11]]  # two 64-bit words trade places
    assert digest(flipped)[0] != reference[0] and digest(swapped)[0] != reference[0]
    data[[5, 600]] = [np.inf, np.nan]
    assert digest(data)[1] == 2 == digest(data, _scan_numpy)[1]


# ----- resume ------------------------------------------------------------------------------------

def test_more_steps_under_a_schedule_that_depends_on_them_is_refused_and_a_fixed_decay_continues_bit_for_bit(  # noqa: E501
        base, tmp_path, capsys):
    run = _copy(base, tmp_path)
    assert main(["train", "tiny", *_args(run, "loop.steps=6")]) == 2
    line = _error_line(capsys)
    assert "loop.steps: 4 -> 6 with schedule.decay_steps=0" in line
    assert "schedule.decay_steps=4" in line and "loop.accept_changes=true" in line
    # On purpose, from the older checkpoint (4 moved away): steps 3 and 4 are trained again.
    shutil.rmtree(run / "checkpoints" / "4")
    resumed = train(tiny(*_args(run, "loop.steps=6", "schedule.decay_steps=4")))
    straight = train(tiny(*_args(tmp_path / "straight", "loop.steps=6",
                                 "schedule.decay_steps=4")))
    b, a = _losses(run), _losses(tmp_path / "straight")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # metrics.jsonl went back to step 2 first
    assert [b[s] for s in range(3, 7)] == [a[s] for s in range(3, 7)]  # bit for bit
    assert [b[s] for s in (3, 4)] == [_losses(base[0])[s] for s in (3, 4)]
    for x, y in zip(jax.tree.leaves(resumed["state"].params),
                    jax.tree.leaves(straight["state"].params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_optimizer_and_data_changes_are_named_and_can_be_accepted(base):
    folder = base[0] / "checkpoints" / "4"
    meta = Checkpointer(folder.parent).read_meta(4)
    cfg = tiny(*_args(base[0], "loop.steps=6", "schedule.decay_steps=4", "optim.b2=0.99",
                      "data.seed=7"))
    with pytest.raises(Exception, match=r"optim.b2: 0.95 -> 0.99; data.seed: 0 -> 7"):
        check_continues(cfg, meta, folder)
    check_continues(tiny(*_args(base[0], "loop.steps=6", "optim.b2=0.99", "data.seed=7",
                                "loop.accept_changes=true")), meta, folder)


def test_the_summary_gives_the_runs_speed_after_its_first_step(base):
    """tokens/s of the summary: the tokens of every step after the first (which compiles)
    over those steps' wall time, as metrics.jsonl's records add them up."""
    records = [json.loads(line) for line in (base[0] / "metrics.jsonl").read_text().splitlines()]
    summary, tokens_per_step = base[1], tiny().data.tokens_per_step
    steps = [r["step"] - before["step"] for before, r in zip(records, records[1:])]
    seconds = sum(n * r["step_seconds"] for n, r in zip(steps, records[1:]))
    assert records[0]["step"] == 1 and summary["timed_steps"] == sum(steps) == 3
    assert summary["timed_s"] == pytest.approx(seconds, rel=1e-9)
    assert summary["tokens_per_s"] == pytest.approx(3 * tokens_per_step / seconds, rel=1e-9)


# ----- errors a user can act on ------------------------------------------------------------------

def _token_file(tmp_path, name, values):
    path = tmp_path / name
    np.save(path, values) if name.endswith(".npy") else path.write_text(values)
    return f"data.source={path}"


ERRORS = {
    "jsonl": (lambda p: [_token_file(p, "chat.jsonl", '{"text": "hi"}\n')],
              "not a token file (.npy or .bin); text and JSONL are tokenized first: "
              "`megatrain-jax prepare"),
    "text": (lambda p: [_token_file(p, "book.txt", "In the beginning")], "megatrain-jax prepare"),
    "negative id": (lambda p: [_token_file(p, "ids.npy", np.array([1, -1, 254] * 50, np.int32))],
                    "holds token id -1: ids are never negative"),
    "float ids": (lambda p: [_token_file(p, "ids.npy", np.ones(500, np.float32))],
                  "holds float32 values"),
    "missing source": (lambda p: [f"data.source={p / 'nothing'}"], "no such file or folder"),
    "unknown top-level key": (lambda p: ["steps=5"], "Did you mean 'loop.steps'?"),
    "run_dir under a file": (lambda p: [_token_file(p, "f.txt", "") and
                                        f"loop.run_dir={p}/f.txt/r"],
                             "is not a folder this process can write into"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_data_and_config_errors_are_one_clear_line_and_exit_2(case, tmp_path, capsys):
    overrides, expected = ERRORS[case]
    run = tmp_path / "run"
    assert main(["train", "tiny", *_args(run, *overrides(tmp_path))]) == 2
    assert expected in _error_line(capsys)
    assert not run.exists()


def test_config_files_that_are_not_configs_are_named(tmp_path, capsys):
    (tmp_path / "list.json").write_text("[1, 2]")
    assert main(["train", str(tmp_path / "list.json")]) == 2
    assert "list.json: a config is a JSON object of sections" in _error_line(capsys)
    (tmp_path / "bad.gin").write_text("model.layers = 2\nmodel.hidden 64\n")
    assert main(["train", str(tmp_path / "bad.gin")]) == 2
    assert f"{tmp_path / 'bad.gin'}:2: gin syntax error: Couldn't parse statement" in \
        _error_line(capsys)


def test_exported_files_are_readable_by_all(tmp_path):
    from megatrain_jax import model
    from megatrain_jax.io import hf

    cfg = tiny()
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), model.abstract(cfg.model))
    umask = os.umask(0o022)
    try:
        out = hf.save_params(params, cfg.model, tmp_path / "out")
    finally:
        os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}
