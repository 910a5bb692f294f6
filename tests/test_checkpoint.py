"""Checkpoints: exact resume, placement on restore, keep-N, atomicity, clear errors."""

import json
import os
import shutil
import threading

import jax
import numpy as np
import pytest
from conftest import tiny

from megatrain_jax.config import ConfigError
from megatrain_jax.io.checkpoint import Checkpointer, CheckpointError
from megatrain_jax.stream.placement import memory_kinds
from megatrain_jax.train import make_trainer, train


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _cfg(run_dir, *more):
    return tiny("model.layers=2", "loop.log_every=1", "loop.progress=none",
                "loop.checkpoint_every=5", "loop.tensorboard=off", "loop.timeline_step=-1",
                "schedule.warmup_steps=2", "schedule.decay_steps=10", f"loop.run_dir={run_dir}",
                *more)


TRAINERS = {"stream": ["loop.trainer=stream"], "reference": ["loop.trainer=reference"],
            "stream_resident": ["loop.trainer=stream", "stream.resident_layers=1"]}
FP8 = ["loop.trainer=stream", "model.compute_dtype=bfloat16", "model.fp8_matmuls=true"]


@pytest.mark.parametrize("trainer", [*sorted(TRAINERS), "fp8"])
def test_resume_gives_the_same_losses_as_an_unbroken_run(tmp_path, trainer):
    keys = FP8 if trainer == "fp8" else TRAINERS[trainer]
    half = 3 if trainer == "fp8" else 5  # FP8 dots are emulated on the CPU: fewer steps
    keys = [*keys, f"loop.checkpoint_every={half}"]
    straight = train(_cfg(tmp_path / "a", f"loop.steps={2 * half}", *keys))
    train(_cfg(tmp_path / "b", f"loop.steps={half}", *keys))
    resumed = train(_cfg(tmp_path / "b", f"loop.steps={2 * half}", *keys))
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(b) == list(range(1, 2 * half + 1))  # the resumed run appended to metrics
    later = range(half + 1, 2 * half + 1)
    assert [b[s] for s in later] == [a[s] for s in later]  # bit for bit
    params = jax.tree.leaves(straight["state"].params)
    for x, y in zip(params, jax.tree.leaves(resumed["state"].params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_with_packed_instruction_data_and_evals(tmp_path):
    """Data order over epochs of packed examples, and the eval loss, survive a resume."""
    from megatrain_jax.io.prepare import prepare

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "response": f" {i + 1}"}) + "\n"
                             for i in range(30)))
    prepare([str(pairs)], tmp_path / "data", progress="none")
    more = [f"data.source={tmp_path / 'data'}", "data.seq_len=32", "data.batch_size=4",
            "data.val_fraction=0.1", "loop.eval_every=5", "loop.eval_batches=1"]
    train(_cfg(tmp_path / "a", "loop.steps=10", *more))
    train(_cfg(tmp_path / "b", "loop.steps=5", *more))
    train(_cfg(tmp_path / "b", "loop.steps=10", *more))
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert [b[s] for s in range(6, 11)] == [a[s] for s in range(6, 11)]
    evals = [(tmp_path / run / "eval.jsonl").read_text() for run in ("a", "b")]
    assert evals[0] == evals[1] and evals[0].count("\n") == 2  # steps 5 and 10


def test_restore_goes_straight_to_pinned_host(tmp_path):
    """The weights into pinned memory, the optimizer state into the plain host memory where
    the host update keeps it."""
    cfg = _cfg(tmp_path, "loop.steps=5")
    train(cfg)
    trainer = make_trainer(cfg)
    ckpt = Checkpointer(tmp_path / "checkpoints")
    tree, meta = ckpt.restore(5, trainer.abstract_state())
    assert memory_kinds(tree["params"]) == {"pinned_host"}
    assert memory_kinds(tree["opt_state"]) == {"unpinned_host"}
    assert meta["step"] == 5 and meta["data_position"] == 5
    assert int(tree["opt_state"]["layers"][0][0].count) == 5
    # The same checkpoint restored for a run that keeps layer 0 on the GPU.
    resident = make_trainer(_cfg(tmp_path, "loop.steps=5", "stream.resident_layers=1"))
    again, _ = ckpt.restore(5, resident.abstract_state())
    assert memory_kinds(again["params"]["layers"][0]) == {"device"}
    assert memory_kinds((again["params"]["layers"][1], again["params"]["embed"])) == \
        {"pinned_host"}
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_keeps_the_last_n(tmp_path):
    train(_cfg(tmp_path, "loop.steps=8", "loop.checkpoint_every=2", "loop.keep_checkpoints=2"))
    assert Checkpointer(tmp_path / "checkpoints").steps() == [6, 8]


def test_an_unfinished_save_is_invisible(tmp_path):
    train(_cfg(tmp_path, "loop.steps=5"))
    folder = tmp_path / "checkpoints"
    # what a process killed mid-save leaves: a folder under a temporary name, half written
    shutil.copytree(folder / "5", folder / "10.partial")
    (folder / "10.partial" / "manifest.json").unlink()
    assert Checkpointer(folder).latest_step() == 5
    resumed = train(_cfg(tmp_path, "loop.steps=7"))
    assert resumed["state"].step == 7
    assert Checkpointer(folder).steps() == [5, 7] and not (folder / "10.partial").exists()


def test_truncated_checkpoint_names_the_file(tmp_path):
    cfg = _cfg(tmp_path, "loop.steps=5")
    train(cfg)
    biggest = max((tmp_path / "checkpoints" / "5").glob("*.bin"), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 3])
    with pytest.raises(CheckpointError, match=rf"checkpoint 5 is damaged: .*{biggest.name} holds"):
        train(_cfg(tmp_path, "loop.steps=8"))


def test_checkpoint_of_another_model_is_refused_with_the_difference(tmp_path):
    train(_cfg(tmp_path, "loop.steps=5"))
    with pytest.raises(CheckpointError, match=r"model.hidden: checkpoint 32 vs config 48"):
        train(_cfg(tmp_path, "loop.steps=8", "model.hidden=48"))
    assert train(_cfg(tmp_path, "loop.steps=5"))["finished_before"]  # nothing left to do
    with pytest.raises(ConfigError, match="already holds step 5, past loop.steps=4"):
        train(_cfg(tmp_path, "loop.steps=4"))


@pytest.mark.parametrize("trainer, parts", [("stream", None), ("stream", 1),
                                           ("stream_resident", None), ("stream_resident", 1),
                                           ("stream_resident", 0), ("reference", None)])
def test_a_save_captures_the_state_and_writes_it_while_training_goes_on(
        tmp_path, monkeypatch, trainer, parts):
    """A save copies the state into its staging area and returns: the next steps run, and
    update the state (in place on the host, by donation on the GPU), while no file of the
    save is written yet; the checkpoint holds the state of its step, bit for bit. Part by part
    (one part staged at a time), a step's update waits for its parts' capture, which waits for
    the disk, and the checkpoint is the same. With none staged (0), each part is written
    from the state itself, its update waiting for the write: the same checkpoint again."""
    import threading

    from megatrain_jax.io import array_files
    from megatrain_jax.io.data import TokenSource

    cfg = _cfg(tmp_path, "loop.steps=2", "stream.resident_embeddings=on", *TRAINERS[trainer])
    run = make_trainer(cfg)
    state = run.init(jax.random.key(0))
    data = TokenSource(run.cfg)
    state, _ = run.train_step(state, data.batch_at(0))
    tree = run.state_tree(state)
    before = jax.tree.map(lambda a: np.array(a, copy=True), tree)
    assert {"device"} in [memory_kinds(leaf) for leaf in jax.tree.leaves(tree)]

    release, write = threading.Event(), array_files.write_array

    def held_write(path, pieces, dtype):  # no file is written until the test says so
        release.wait()
        return write(path, pieces, dtype)

    monkeypatch.setattr(array_files, "write_array", held_write)
    ckpt = Checkpointer(tmp_path / "checkpoints", staging_parts=parts)
    ckpt.prepare(tree)  # the staging area, made before the first save, as a run does
    ckpt.wait()
    reserved = ckpt.staging.held_bytes
    ckpt.save(1, tree, {"step": 1})

    def steps():
        nonlocal state
        for n in (1, 2):
            state, _ = run.train_step(state, data.batch_at(n), before_write=ckpt.wait_captured)
        jax.block_until_ready(jax.tree.leaves(run.state_tree(state.wait() if hasattr(
            state, "wait") else state)))

    stepping = threading.Thread(target=steps)
    stepping.start()
    stepping.join(None if parts is None else 1.0)
    assert stepping.is_alive() == (parts is not None)  # part by part, the disk paces it
    assert ckpt.saving() == 1
    release.set()
    stepping.join()
    ckpt.wait()
    after = jax.tree.leaves(run.state_tree(state))
    assert any(not np.array_equal(x, np.asarray(y)) for x, y in zip(jax.tree.leaves(before),
                                                                      after))
    restored, _ = ckpt.restore(1, run.abstract_state())
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(x, np.asarray(y))
    host = [leaf.nbytes for leaf in jax.tree.leaves(tree) if memory_kinds(leaf) != {"device"}]
    assert ckpt.staging.held_bytes == reserved  # the save used what was made for it
    if parts == 0:  # no copy at all
        assert ckpt.staging.held_bytes == 0
    elif parts is not None:  # one part's buffers, lent and given back, not a copy of the state
        layer = sum(x.nbytes for x in jax.tree.leaves((tree["params"]["layers"][0],
                                                      tree["opt_state"]["layers"][0])))
        assert 0 < ckpt.staging.held_bytes <= layer <= sum(host)
    elif trainer == "stream":
        assert ckpt.staging.held_bytes == sum(host)


def test_a_device_read_copies_in_slices_and_leaves_no_host_copy_on_the_array(monkeypatch):
    """DeviceRead copies a device array through fresh slices of at most READ_BYTES: the bytes
    are the array's, and JAX keeps no host copy on the array itself (it would live until the
    state is donated: a second copy of the GPU's state in host memory)."""
    import jax.numpy as jnp

    from megatrain_jax.io import array_files

    monkeypatch.setattr(array_files, "READ_BYTES", 3 * 5 * 4)  # three rows a slice
    expected = [np.arange(35, dtype=np.float32).reshape(7, 5) - 17.0,
                np.asarray(-0.0, np.float32), np.full((4,), 3, jnp.bfloat16)]
    for want in expected:
        x = jnp.asarray(want)
        assert array_files.DeviceRead(x)().tobytes() == want.tobytes()
        assert getattr(x, "_npy_value", None) is None


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priorities: Linux")
def test_a_saves_background_threads_give_way_to_training(tmp_path):
    def priority():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    ckpt = Checkpointer(tmp_path)
    try:
        wanted = min(19, priority() + 10)
        assert ckpt._runner.submit(priority).result() == wanted
        assert ckpt._pool.submit(priority).result() == wanted
        assert priority() < wanted  # the caller's own thread is left as it was
    finally:
        ckpt.close()
