"""Checkpoints of a run of several processes (io/saving.py, io/shards.py, train/export.py).

How the processes agree on a save is shown first with processes played by threads, over a
key-value store like the coordination service's: a step appears only once every process's
part is verified, and a failure (or silence) anywhere leaves only the earlier checkpoints.

Two `megatrain-jax train` processes with two CPU devices each, joined by jax.distributed,
checkpoint a run; one is killed (SIGKILL) in the middle of the last save, which the test
makes deterministic with MEGATRAIN_JAX_TEST_PAUSE_SAVE. The earlier checkpoint then resumes
on two processes and on one process with one device, each with the unbroken run's losses
(tests/test_mesh.py resumes four devices' checkpoint on two), and both exports
(loop.export_dir of the run of two processes, and `megatrain-jax export` here, in one
process) load in transformers with the run's logits.
The runs share one fixture: processes are the slow part.

A clean stop (SIGTERM) that reaches one process of a run stops every process after the same
step, with the same save (train/stop.py's AgreedStop): shown over threads, then with two
processes of which only the second gets the signal.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SEVERAL_PROCESSES, free_port, process_env

from megatrain_jax.io import array_files, processes, saving
from megatrain_jax.io.checkpoint import Checkpointer, CheckpointError, complete_steps
from megatrain_jax.io.processes import Peers
from megatrain_jax.io.saving import PAUSE_SAVE, Writer
from megatrain_jax.io.staging import Staging
from megatrain_jax.train.stop import AgreedStop

STEPS, EVERY = 4, 2  # checkpoints 2 and 4; process 1 is killed while saving 4
OVERRIDES = ["model.compute_dtype=float32", "model.attention=xla", "optim.lr=1e-2",
             f"loop.steps={STEPS}", f"loop.checkpoint_every={EVERY}", "loop.progress=none",
             "loop.log_every=1", "loop.tensorboard=off", "loop.timeline_step=-1"]


class _Store:
    """The coordination service's key-value store, for processes played by threads."""

    def __init__(self):
        self.values, self.changed = {}, threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise RuntimeError("DEADLINE_EXCEEDED: the key was not set")
            return self.values[key]

    def key_value_dir_get(self, folder: str) -> list[tuple[str, str]]:
        with self.changed:
            return [(k, v) for k, v in self.values.items() if k.startswith(folder)]


WHOLE = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)


def _save_by_threads(folder: Path, step: int, running=(0, 1), nan_in=None) -> dict:
    """Checkpoint `step` of WHOLE saved by two processes (threads), each holding three of its
    columns; those in `running` take part. Returns what each raised, or "ok"."""
    store, pool, outcome = _Store(), ThreadPoolExecutor(4), {}

    def process(index: int) -> None:
        peers = Peers(store, index, 2)
        peers.prefix = "test"  # both threads' messages in one namespace, as in two processes
        block = np.ascontiguousarray(WHOLE[:, 3 * index:3 * index + 3])
        if index == nan_in:
            block[1, 1] = np.nan
        region = ((0, 8), (3 * index, 3 * index + 3))
        sources = [{"key": "['w']", "name": "w", "shape": [8, 6], "dtype": "float32",
                    "shards": [(region, f"w@0.{3 * index}.bin",
                                [array_files.byte_view(block)], np.dtype(np.float32))]}]
        try:
            Writer(folder, pool, peers).save(step, Staging().capture(sources), {"step": step})
            outcome[index] = "ok"
        except Exception as e:
            outcome[index] = e

    threads = [threading.Thread(target=process, args=(i,)) for i in running]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    pool.shutdown()
    return outcome


def test_a_step_of_several_processes_appears_whole_once_every_part_is_verified(tmp_path):
    assert _save_by_threads(tmp_path, 5) == {0: "ok", 1: "ok"}
    ckpt = Checkpointer(tmp_path)
    assert ckpt.steps() == [5] and not list(tmp_path.glob("*.partial"))
    tree, meta = ckpt.restore(5, {"w": jax.ShapeDtypeStruct((8, 6), np.float32)})
    np.testing.assert_array_equal(tree["w"], WHOLE)
    assert meta == {"step": 5}


def test_a_failing_process_fails_the_save_of_every_process_and_keeps_the_earlier(tmp_path):
    assert _save_by_threads(tmp_path, 3) == {0: "ok", 1: "ok"}
    outcome = _save_by_threads(tmp_path, 5, nan_in=1)
    assert isinstance(outcome[1], CheckpointError) and "non-finite values (w)" in str(outcome[1])
    assert isinstance(outcome[0], CheckpointError)
    assert str(outcome[0]).startswith("process 1: checkpoint 5 not written: the state holds "
                                      "non-finite values (w)")
    assert Checkpointer(tmp_path).steps() == [3] and not list(tmp_path.glob("*.partial"))


def test_a_process_that_never_answers_leaves_the_step_invisible(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "WAIT_S", 0.5)
    (outcome,) = _save_by_threads(tmp_path, 5, running=(0,)).values()
    assert isinstance(outcome, CheckpointError)
    assert "checkpoint 5 not written: process 1 did not answer within" in str(outcome)
    assert Checkpointer(tmp_path).steps() == [] and not list(tmp_path.glob("*.partial"))


def _decide_by_threads(store: _Store, stops: list, key: str, last: bool = False) -> list:
    """Both processes' decision after step `key`; process 0 still commits checkpoint 2, while
    process 1's part of it is done. Process 0 decides once a signal of process 1 is told."""
    peers = [Peers(store, i, 2) for i in (0, 1)]
    for p in peers:
        p.prefix = "test"
    with ThreadPoolExecutor(1) as pool:
        follower = pool.submit(AgreedStop(stops[1], peers[1]).decide, key, last, lambda: None)
        end = time.monotonic() + 10
        while stops[1].signal is not None and not peers[0].said("stop-request"):
            assert time.monotonic() < end
            time.sleep(0.01)
        return [AgreedStop(stops[0], peers[0]).decide(key, last, lambda: 2),
                follower.result(timeout=10)]


def test_a_signal_to_any_process_stops_every_process_after_the_same_step():
    from types import SimpleNamespace

    store, stops = _Store(), [SimpleNamespace(signal=None), SimpleNamespace(signal=None)]
    assert _decide_by_threads(store, stops, "1") == [(None, None)] * 2
    stops[1].signal = signal.SIGTERM  # the second process only
    assert _decide_by_threads(store, stops, "2", last=True) == [(None, None)] * 2  # finishes
    assert _decide_by_threads(store, stops, "3") == [(signal.SIGTERM, 2)] * 2
    stops = [SimpleNamespace(signal=signal.SIGINT), SimpleNamespace(signal=None)]
    assert _decide_by_threads(_Store(), stops, "4") == [(signal.SIGINT, 2)] * 2


def test_each_shard_is_written_from_its_own_pinned_buffer():
    """As one process writes its arrays: a view of the buffer, no copy."""
    from megatrain_jax.stream.placement import HOST_KIND, Placement

    tree = Placement().place({"w": np.ones((8, 4), np.float32)}, HOST_KIND)
    (source,) = saving.sources(tree, whole=False)
    ((region, file, (data,), _),) = source["shards"]
    assert region == ((0, 8), (0, 4)) and file == "w@0.0.bin"
    buffer = tree["w"].addressable_shards[0].data.unsafe_buffer_pointer()
    assert data.ctypes.data == buffer and not data.flags.writeable


def _train(run_dir: Path, devices: int, processes: int = 1, pause: int | None = None,
           *more: str) -> list[subprocess.Popen]:
    """`megatrain-jax train tiny` in `processes` processes of `devices` CPU devices each,
    sharing the test session's compilation cache; process 1 pauses in the save of `pause`."""
    env = process_env(f"{SEVERAL_PROCESSES} --xla_force_host_platform_device_count={devices}")
    command = [sys.executable, "-m", "megatrain_jax.cli", "train", "tiny", *OVERRIDES,
               f"loop.run_dir={run_dir}", *more]
    if processes == 1:
        return [subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)]
    port = free_port()
    return [subprocess.Popen(
        [*command, "--coordinator", f"localhost:{port}", "--processes", str(processes),
         "--process-id", str(i)],
        env={**env, **({PAUSE_SAVE: str(pause)} if pause and i == 1 else {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(processes)]


def _finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-6000:]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl")
                                              .read_text().splitlines())}


def _wait_for(condition, procs: list[subprocess.Popen], timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if any(p.poll() is not None for p in procs) or time.monotonic() > end:
            for p in procs:
                p.kill()
            outputs = [p.communicate()[0][-3000:] for p in procs]
            pytest.fail("the run did not reach the save to kill:\n" + "\n".join(outputs))
        time.sleep(0.1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("processes")
    killed = folder / "killed"
    procs = _train(killed, 2, 2, STEPS)
    partial = killed / "checkpoints" / f"{STEPS}.partial"
    # Process 1 has written and verified its shards of the last save and pauses before it
    # says so; process 0 has written its part, logged the last step, and waits for it.
    _wait_for(lambda: (partial / "paused-1").exists() and (partial / "part-0.json").exists()
              and STEPS in _losses(killed), procs)
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].wait()
    time.sleep(0.5)  # what process 0 would publish without process 1's word, it would by now
    seen = {"steps": complete_steps(killed / "checkpoints"),
            "folders": sorted(p.name for p in (killed / "checkpoints").iterdir()),
            "partial": sorted(p.name for p in partial.iterdir())}
    procs[0].kill()  # else the coordination service ends it when process 1's heartbeats stop
    procs[0].wait()
    unbroken = _losses(killed)
    for name in ("two", "one"):
        shutil.copytree(killed, folder / name)
    resumed = [*_train(folder / "two", 2, 2, None, f"loop.export_dir={folder / 'final'}"),
               *_train(folder / "one", 1)]
    _finish(resumed)
    return folder, seen, unbroken


def test_a_process_killed_during_a_save_leaves_the_step_invisible(runs):
    folder, seen, unbroken = runs
    assert sorted(unbroken) == list(range(1, STEPS + 1))
    assert seen["steps"] == [EVERY]  # the earlier checkpoint, untouched
    assert seen["folders"] == [str(EVERY), f"{STEPS}.partial"]
    partial = seen["partial"]
    assert "manifest.json" not in partial and "part-1.json" not in partial
    assert "part-0.json" in partial and any(name.endswith(".bin") for name in partial)


def test_the_checkpoint_of_two_processes_resumes_on_two_and_on_one_device(runs):
    folder, _, unbroken = runs
    later = range(EVERY + 1, STEPS + 1)
    for name in ("two", "one"):
        losses = _losses(folder / name)
        assert sorted(losses) == list(range(1, STEPS + 1)), name
        np.testing.assert_allclose([losses[s] for s in later], [unbroken[s] for s in later],
                                   rtol=1e-6, err_msg=name)
        assert Checkpointer(folder / name / "checkpoints").steps() == [EVERY, STEPS]
        assert not list((folder / name / "checkpoints").glob("*.partial"))  # the killed save's
    manifest = json.loads((folder / "two" / "checkpoints" / str(STEPS) / "manifest.json")
                          .read_text())
    table = next(a for a in manifest["arrays"] if a["key"] == "['params']['embed'].table")
    assert len(table["shards"]) == 4  # one per device of the two processes, none gathered


def test_exports_of_the_run_of_two_processes_load_in_transformers_with_its_logits(runs):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from megatrain_jax import model
    from megatrain_jax.cli import main
    from megatrain_jax.config import load_run_config
    from megatrain_jax.train.export import read_params

    folder, _, _ = runs
    out = folder / "exported"
    assert main(["export", str(folder / "two"), str(out), "--progress", "none"]) == 0
    cfg = load_run_config(folder / "two")
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 24))

    def ours(run: str, step: int) -> np.ndarray:
        params = read_params(Checkpointer(folder / run / "checkpoints"), step, cfg)
        return np.asarray(model.logits(params, tokens, cfg.model))

    def theirs(exported: Path) -> np.ndarray:
        m = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32,
                                                              attn_implementation="eager")
        with torch.no_grad():
            return m.eval()(torch.tensor(tokens)).logits.numpy()

    # The run's model: its last checkpoint as one process on one device wrote it, whole.
    expected = ours("one", STEPS)
    assert np.max(np.abs(expected - ours("one", EVERY))) > 1e-3  # the steps moved it
    for exported in (out, folder / "final"):  # this process's export, the run's own
        assert np.max(np.abs(theirs(exported) - expected)) <= 1e-4


def test_sigterm_to_one_process_stops_both_cleanly_at_one_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    # Two devices a process, as the killed run's: the cache holds its compiled programs.
    procs = _train(run, 2, 2, None, "loop.steps=100000", "loop.checkpoint_every=100000")
    records = run / "process-1" / "metrics.jsonl"
    _wait_for(lambda: records.exists() and records.read_text().count("\n") >= 2, procs)
    os.kill(procs[1].pid, signal.SIGTERM)  # the first process gets no signal
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [143, 143], outputs
    (at,) = complete_steps(run / "checkpoints")  # the step both stopped at, saved by both
    assert max(_losses(run)) == max(_losses(run / "process-1")) == at
    assert outputs[0].strip().splitlines()[-1].endswith(
        f"stopped by SIGTERM at step {at} of 100000: checkpoint {at} is complete in "
        f"{run / 'checkpoints'}; run the same command to resume.")
