"""The placement planner (planning/planner.py): one decision within a GPU and a host budget,
against exhaustive search; and training under a mixed placement, against the reference."""

import dataclasses
import itertools
import json

import jax
import numpy as np
import pytest
from conftest import max_rel_error, tiny

from megatrain_jax.cli import main
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.io.data import TokenSource
from megatrain_jax.planning import memory, planner, presets, roofline
from megatrain_jax.planning.memory import HEADROOM, PlacementPlan
from megatrain_jax.train import ReferenceTrainer, StreamTrainer, train

GiB = 2**30
H200 = presets.PRESETS["H200"]


def _7b(*overrides, layers=32):
    return load_config("7b", [f"model.layers={layers}", *overrides])


def _plan(cfg, gpu_gib, host_gib=None, rates=None):
    return planner.plan_placement(cfg, int(gpu_gib * GiB),
                                  None if host_gib is None else int(host_gib * GiB), 1,
                                  rates or H200.rates(cfg))


@pytest.mark.parametrize("shape, overrides", [
    ("7b", []), ("3b", []), ("14b", []),
    ("7b", ["data.batch_size=64", "data.micro_batches=4"]),
    ("7b", ["data.batch_size=1", "data.seq_len=65536", "model.max_seq_len=65536"]),
])
def test_the_planner_keeps_within_both_budgets(shape, overrides):
    cfg = load_config(shape, overrides)
    for gpu, host in ((24, 125), (48, 125), (80, 100), (132.8, 125), (132.8, 70)):
        try:
            planned = _plan(cfg, gpu, host)
        except ConfigError:
            continue  # refused: checked below for 30b
        assert sum(planned.device.values()) + HEADROOM <= gpu * GiB
        assert planned.host_total <= host * GiB
        assert planned.host_total == planner.host_total(cfg, planned.plan, 1)


def test_the_predicted_step_does_not_grow_with_the_gpu_budget():
    for cfg, host in ((_7b(), 125), (load_config("14b"), 250),
                      (_7b("data.batch_size=64", "data.micro_batches=4"), 125)):
        steps = [_plan(cfg, gpu, host).step_s for gpu in (24, 32, 48, 64, 80, 100, 120, 132.8)]
        assert all(b <= a * (1 + 1e-12) for a, b in zip(steps, steps[1:])), steps
        assert steps[-1] < steps[0]


def test_where_the_whole_model_fits_every_layer_is_resident_and_saves_its_activations():
    cfg = load_config("1b")
    whole = memory.device_bytes(cfg, PlacementPlan(16, True, 16), 1)
    planned = _plan(cfg, (sum(whole.values()) + HEADROOM) / GiB + 0.01)
    assert planned.plan == PlacementPlan(16, True, 16, 0, 0, 0)
    assert planned.step_s <= planner.score(cfg, PlacementPlan(15, True, 16), H200.rates(cfg), 1)


def test_pins_are_kept_and_the_rest_placed_around_them():
    cfg = _7b("stream.resident_layers=4", "stream.keep_weights=2", "stream.saved_inputs=device")
    planned = _plan(cfg, 80, 125)
    assert planned.plan.resident_layers == 4 and planned.plan.weight_layers == 2
    assert planned.plan.host_inputs == 0
    free = _plan(_7b(), 80, 125)
    assert free.step_s <= planned.step_s  # a pin only narrows the choice
    resolved = planner.resolve(cfg, 80 * GiB, 125 * GiB, 1, H200.rates(cfg))
    assert memory.plan_of(resolved) == planned.plan
    assert resolved.stream.resident_layers == "4" and resolved.stream.keep_weights == "2"
    with pytest.raises(ConfigError, match="GPU budget is 10.0 GiB"):
        _plan(_7b("stream.resident_layers=32"), 10)


def _exhaustive(cfg, gpu, host, rates):
    """The best score of every placement the budgets allow, searched one by one."""
    layers, best = cfg.model.layers, np.inf
    for r, s, e in itertools.product(range(layers + 1), range(layers + 1), (False, True)):
        for w, h in itertools.product(range(max(0, layers - s - r) + 1), range(layers - s + 1)):
            plan = PlacementPlan(r, e, s, 0, w, h)
            if (sum(memory.device_bytes(cfg, plan, 1).values()) + HEADROOM > gpu
                    or planner.host_total(cfg, plan, 1) > host):
                continue
            best = min(best, float(planner.score(cfg, plan, rates, 1)))
    return best


@pytest.mark.parametrize("gpu_gib, host_gib, overrides", [
    (15, 64, []), (18, 64, []), (22, 64, []), (30, 64, []),
    (16, 50, ["optim.state_dtype=bfloat16"]), (20, 64, ["data.batch_size=32"]),
    (26, 64, ["data.batch_size=64", "data.micro_batches=4"]),
])
def test_the_search_finds_the_best_of_every_placement(gpu_gib, host_gib, overrides):
    """Saved inputs on the GPU first and kept weights in the room left lose nothing against
    every placement searched one by one (4 layers of 7b's width, where the budgets bind)."""
    cfg = _7b(*overrides, layers=4)
    gpu, host = int(gpu_gib * GiB), int(host_gib * GiB)
    for rates in (H200.rates(cfg), dataclasses.replace(H200.rates(cfg), h2d_gbps=12.0),
                  presets.PRESETS["GH200"].rates(cfg)):
        planned = planner.plan_placement(cfg, gpu, host, 1, rates)
        assert planned.step_s == pytest.approx(_exhaustive(cfg, gpu, host, rates), rel=1e-12)


def test_the_bound_counts_what_each_choice_saves():
    cfg, rates = _7b(), H200.rates(_7b())
    streamed = roofline.bound_of(cfg, PlacementPlan(), rates, 1)
    resident = roofline.bound_of(cfg, PlacementPlan(resident_layers=16), rates, 1)
    assert resident["optimizer_s"] == pytest.approx(streamed["optimizer_s"] * 0.5, rel=0.05)
    assert resident["resident_update_s"] > 0 == streamed["resident_update_s"]
    saving = roofline.bound_of(cfg, PlacementPlan(saving_layers=8), rates, 1)
    assert streamed["compute_backward_s"] - saving["compute_backward_s"] == pytest.approx(
        8 * rates.saved_by_saving())
    on_host = roofline.bound_of(cfg, PlacementPlan(host_inputs=10), rates, 1)
    moved = 10 * memory.saved_per_layer(cfg)
    assert on_host["inputs_to_host_s"] == pytest.approx(moved / (rates.d2h_gbps * 1e9))
    assert on_host["h2d_backward_s"] - streamed["h2d_backward_s"] == pytest.approx(
        moved / (rates.h2d_gbps * 1e9))


def test_capacity_is_host_and_gpu_together(capsys):
    assert main(["plan", "14b", "--host-gb", "125", "--gpu-gb", "140"]) == 0
    out = capsys.readouterr().out
    assert "-> fits" in out and "resident" in out
    cfg = load_config("14b")
    assert planner.closest(cfg, None, 1) == PlacementPlan()  # the host alone does not hold it
    with pytest.raises(ConfigError):
        _plan(cfg, 0.001, 125)
    assert main(["plan", "30b", "--host-gb", "125", "--gpu-gb", "140"]) == 1
    err = capsys.readouterr().err
    assert "does not fit" in err and "GiB of host memory" in err and "of its 60 layers" in err


def test_plan_prints_the_placement_and_the_budgets(capsys):
    assert main(["plan", "7b", "--host-gb", "125", "--gpu-gb", "139.8",
                 "--budgets", "24,80"]) == 0
    out = capsys.readouterr().out
    assert "placement (GPU budget" in out and "saved input on" in out
    assert "step bound:" in out and "expected:" in out
    rows = [line.split() for line in out.splitlines()[-2:]]
    assert [row[0] for row in rows] == ["24", "80"]
    assert int(rows[0][1]) < int(rows[1][1])  # more of the model resident with more room
    assert main(["plan", "7b", "--budgets", "x"]) == 2


# ----- training under a mixed placement, on the CPU (its memory stands in for the GPU's) ---

MIXED = ["model.layers=5", "data.batch_size=4", "optim.lr=3e-2", "optim.clip_norm=1.5",
         "model.compute_dtype=float32", "stream.resident_layers=2", "stream.keep_layers=1",
         "stream.keep_weights=1", "stream.saved_inputs=1", "stream.resident_embeddings=on"]


def test_a_mixed_placement_trains_as_the_reference():
    """Two layers resident, one streamed keeping its weights, one saving its activations, one
    input on the host: 12 fp32 steps, some clipped and some not, equal to the reference."""
    cfg = tiny(*MIXED, "stream.keep_attention=0")
    stream, reference = StreamTrainer(cfg), ReferenceTrainer(cfg)
    assert memory.plan_of(stream.cfg) == PlacementPlan(2, True, 1, 0, 1, 1)
    data = TokenSource(cfg)
    params = jax.tree.map(np.asarray, reference.init(jax.random.key(1)).params)
    s, r = stream.init(None, params=params), reference.init(None, params=params)
    norms = []
    for step in range(12):
        s, ms = stream.train_step(s, data.batch_at(step))
        r, mr = reference.train_step(r, data.batch_at(step))
        np.testing.assert_allclose(float(ms["loss"]), float(mr["loss"]), rtol=1e-5)
        norms.append(float(mr["grad_norm"]))
    assert any(n > 1.5 for n in norms) and any(n <= 1.5 for n in norms), norms
    assert max_rel_error(s.params, r.params) <= 1e-5


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_a_mixed_placement_resumes_bit_for_bit_and_under_another_budget(tmp_path):
    loop = ["loop.log_every=1", "loop.checkpoint_every=3", "loop.progress=none",
            "loop.tensorboard=off", "loop.timeline_step=-1"]
    whole = tiny(*MIXED, *loop, "loop.steps=6", f"loop.run_dir={tmp_path / 'whole'}")
    train(whole)
    first = tiny(*MIXED, *loop, "loop.steps=3", f"loop.run_dir={tmp_path / 'split'}")
    train(first)
    train(dataclasses.replace(first, loop=dataclasses.replace(first.loop, steps=6)))
    assert _losses(tmp_path / "split") == _losses(tmp_path / "whole")  # bit for bit
    # Resumed with every layer streamed, as a smaller GPU budget would place it: the same
    # state, another placement, the same losses.
    streamed = tiny(*MIXED[:5], *loop, "loop.steps=6", f"loop.run_dir={tmp_path / 'split'}",
                    "stream.resident_layers=0", "stream.keep_layers=0", "stream.keep_weights=0",
                    "stream.saved_inputs=device", "stream.resident_embeddings=off")
    (tmp_path / "split" / "checkpoints" / "6").rename(tmp_path / "six")  # resume at 3
    train(streamed)
    np.testing.assert_allclose(_losses(tmp_path / "split"), _losses(tmp_path / "whole"),
                               rtol=1e-6)


def test_a_gpu_budget_places_layers_on_the_device_the_trainer_runs_on():
    cfg = tiny("model.layers=4", "stream.gpu_budget_gb=4")
    trainer = StreamTrainer(cfg)
    placed = memory.plan_of(trainer.cfg)
    assert placed.resident_layers == 4 and trainer.engine.placement.resident_layers == 4
    assert memory.plan_of(StreamTrainer(tiny("model.layers=4")).cfg) == PlacementPlan()
