"""Several devices: data parallel over a mesh with one sharded host state (stream/mesh.py).

CPU devices stand in for GPUs; the device count is fixed when JAX starts, so each run is a
subprocess (tests/mesh_runs.py) with XLA_FLAGS of its own.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.train import train

RUNS = Path(__file__).resolve().parent / "mesh_runs.py"
sys.path.insert(0, str(RUNS.parent))
import mesh_runs  # noqa: E402
from conftest import SEVERAL_PROCESSES, free_port, process_env  # noqa: E402


def run(devices: int, scenario: str, out: Path, *args, timeout: int = 600,
        background: bool = False):
    env = process_env()  # its own device count: mesh_runs.py adds it
    command = [sys.executable, str(RUNS), str(devices), scenario, str(out), *map(str, args)]
    if background:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """The 4-device runs: against the reference, and of the training loop."""
    folder = tmp_path_factory.mktemp("mesh4")
    return folder, run(4, "compare", folder / "out.json", folder)


def test_four_devices_equal_the_one_device_reference_over_twenty_clipped_steps(four):
    _, out = four
    host = out["host"]
    assert out["devices"] == 4 and host["mesh"] == 4
    assert any(n > 0.6 for n in host["norms"]) and any(n < 0.6 for n in host["norms"])
    assert any(host["speculated"])  # parts updated during the backward (stream.speculate=on)
    np.testing.assert_allclose(host["losses"], host["ref_losses"], rtol=1e-5)
    # Each device sums its rows' gradients, then the mesh sums those: another order than the
    # reference's, and Adam carries the rounding on (the embedding's rows seen once most: their
    # update is about the sign of one gradient). Measured over these 20 steps: 2.9e-6 on one
    # device, 6.0e-6 on two, 1.2e-5 on four, growing step by step with no jump.
    assert host["params_rel"] <= 2e-5
    resident = out["device_resident"]  # the device update, a resident layer, inputs on host
    np.testing.assert_allclose(resident["losses"], resident["ref_losses"], rtol=1e-5)
    assert resident["params_rel"] <= 1e-5


def test_the_host_kernel_updates_every_shard_as_it_updates_the_whole_leaf(four):
    _, out = four
    assert len(out["kernel_bits_equal"]) == 4 and all(out["kernel_bits_equal"].values()), \
        out["kernel_bits_equal"]


def test_mfu_over_four_devices_divides_by_their_four_peaks(four):
    _, out = four
    assert out["mfu"]
    for mfu, tokens_per_s in out["mfu"]:
        assert mfu == pytest.approx(6 * out["params"] * tokens_per_s / (4 * 1e12), rel=1e-9)


def test_kept_weight_shards_train_the_same_bits_and_travel_once(four):
    kept = four[1]["kept_weights"]
    assert kept["kept_layers"] == 3 and kept["equal"]
    assert kept["fetches_off"] == [2, 2, 2] and kept["fetches_on"] == [1, 1, 1]


def test_every_host_leaf_is_sharded_as_designed_in_pinned_host_memory(four):
    """The weights pinned, the optimizer state (only the host update reads it) in plain host
    memory, each split over the devices alike."""
    _, out = four
    host = out["host"]
    assert host["kinds"] == ["pinned_host", "unpinned_host"] and host["not_as_designed"] == []
    assert host["state_kinds"] == ["unpinned_host"]
    assert host["whole"] == ["()"]  # only the step counts are not split
    # Each device holds a quarter of the weights: one copy of the state over the mesh.
    assert host["host_shard_bytes"] * 4 == host["host_bytes"]
    # And a step fetches a quarter to each device: the host sends its bytes once, not 4 times.
    fetched = host["fetched_per_device"]
    assert len(fetched) == 4 and len(set(fetched)) == 1
    assert sum(fetched) == host["fetched_bytes"] > host["host_bytes"]  # forward + backward
    resident = out["device_resident"]
    assert resident["streamed_kinds"] == ["pinned_host"] and resident["not_as_designed"] == []
    assert "device" in resident["kinds"]


def test_a_checkpoint_from_four_devices_continues_on_one_and_on_two(four, tmp_path):
    folder, out = four
    straight = {int(k): v for k, v in out["straight"].items()}
    assert sorted(straight) == list(range(1, mesh_runs.STEPS + 1))
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(folder / "stopped", one)
    shutil.copytree(folder / "stopped", two)
    on_two = run(2, "resume", tmp_path / "two.json", two)
    assert on_two["devices"] == 2
    train(mesh_runs.loop_cfg(one, f"loop.steps={mesh_runs.STEPS}",
                             f"loop.checkpoint_every={mesh_runs.STOP}"))  # this process: 1
    later = range(mesh_runs.STOP + 1, mesh_runs.STEPS + 1)
    for losses in (mesh_runs.losses(one), {int(k): v for k, v in on_two["losses"].items()}):
        np.testing.assert_allclose([losses[s] for s in later], [straight[s] for s in later],
                                   rtol=1e-5)


def test_a_batch_that_does_not_split_over_the_devices_is_refused_with_the_fix(tmp_path):
    from conftest import tiny

    from megatrain_jax.config import ConfigError
    from megatrain_jax.train.trainers import mesh_for

    with pytest.raises(ConfigError, match="mesh.data=2 asks for more devices than the 1"):
        mesh_for(tiny("mesh.data=2"))


def test_the_nnx_example_runs_on_four_devices(four):
    lines = four[1]["nnx_example"]  # "step   1  loss 6.185  grad_norm 3.283" ...
    losses = [float(line.split()[3]) for line in lines[:-1]]
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0, lines
    # The weights written back into the model, sharded over the 4 devices, run its own forward.
    assert "the model's own forward on the last batch" in lines[-1]


def test_two_processes_of_the_command_line_match_one_process(tmp_path):
    """`megatrain-jax train --coordinator … --processes 2 --process-id I`, one CPU device
    each: the same losses as this process on its one device; the first process writes the
    run's folder, the other only its log."""
    port, run_dir = free_port(), tmp_path / "run"
    env = process_env(SEVERAL_PROCESSES)
    overrides = [*mesh_runs.COMPARED, "model.compute_dtype=float32", "loop.steps=4",
                 f"loop.run_dir={run_dir}", "loop.progress=none", "loop.log_every=1"]
    procs = [subprocess.Popen([sys.executable, "-m", "megatrain_jax.cli", "train", "tiny",
                               *overrides, "--coordinator", f"localhost:{port}",
                               "--processes", "2", "--process-id", str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    single = mesh_runs.single()  # meanwhile, here
    for p in procs:
        output, _ = p.communicate(timeout=600)
        assert p.returncode == 0, output[-6000:]
    assert single["processes"] == 1 and single["devices"] == 1
    first, second = mesh_runs.losses(run_dir), mesh_runs.losses(run_dir / "process-1")
    np.testing.assert_allclose([first[s] for s in range(1, 5)], single["losses"], rtol=1e-6)
    assert first == second
    assert (run_dir / "config.json").exists()
    assert not (run_dir / "process-1" / "tensorboard").exists()


def test_a_run_of_several_processes_refuses_an_export_without_checkpoints_before_it_starts(
        tmp_path, capsys):
    from megatrain_jax.cli import main

    code = main(["train", "tiny", f"loop.export_dir={tmp_path}/out", f"loop.run_dir={tmp_path}/r",
                 "--coordinator", "localhost:1", "--processes", "2", "--process-id", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "set loop.checkpoint_every too" in err and "megatrain-jax export" in err
    assert not (tmp_path / "r").exists()
    code = main(["train", "tiny", "--processes", "2"])
    assert code == 2 and "--coordinator" in capsys.readouterr().err


def test_the_plan_is_per_gpu_for_a_mesh_and_the_host_holds_one_state():
    from megatrain_jax.config import load_config
    from megatrain_jax.planning.memory import PlacementPlan
    from megatrain_jax.planning.planner import pinned_config
    from megatrain_jax.tools import plan

    def streamed(*overrides):  # every part streamed, nothing kept: the same placement
        return pinned_config(load_config("7b", list(overrides)), PlacementPlan())

    fp32_grads = "stream.grad_dtype=float32"
    one = plan.estimate(streamed("mesh.data=1", fp32_grads), gpu=140 * 2**30)
    two = plan.estimate(streamed("mesh.data=2", "data.batch_size=32", fp32_grads),
                        gpu=140 * 2**30)
    assert two["devices"] == 2 and one["devices"] == 1
    # Twice the tokens, the same host state; one pinned pool a GPU, each with its margin.
    assert all(two["host"][k] == one["host"][k] for k in plan.STATE)
    extra = two["host"]["pool_margin"] - one["host"]["pool_margin"]
    assert 0 < extra <= plan.POOL_MARGIN + 2 * 2**30  # the second margin, two roundings
    # Summed over the mesh, the layer gradients are no bf16 values: auto keeps them fp32.
    auto = plan.estimate(streamed("mesh.data=2", "data.batch_size=32"), gpu=140 * 2**30)
    assert auto["host"]["gradients"] == two["host"]["gradients"]
    assert two["device"]["workspace"] == one["device"]["workspace"]  # 16 rows per GPU each
    assert two["device"]["weights_in_flight"] < one["device"]["weights_in_flight"]
    assert two["device_total"] < one["device_total"]
    # The host's bytes a step are one state's; the plan says each GPU's share of the batch.
    lines = plan.traffic_lines(streamed("mesh.data=4"))
    assert "each of the 4 computes 4 x 1,024 tokens a micro-batch" in lines[-1]
    assert len(plan.traffic_lines(streamed("mesh.data=1"))) == 1
