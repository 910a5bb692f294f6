"""Recomputed inputs (`stream.recompute_inputs`): layers whose forward saves no input, the
backward running the forward again from the last input saved before them (CPU)."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest
from conftest import CLIPPED, Transfers, agrees_with_reference_while_clipping, max_rel_error, tiny

from megatrain_jax import model, optim
from megatrain_jax.cli import main
from megatrain_jax.config import load_config
from megatrain_jax.io.data import TokenSource
from megatrain_jax.planning import memory, planner, presets, recompute, roofline
from megatrain_jax.planning.memory import PlacementPlan
from megatrain_jax.stream import StreamEngine
from megatrain_jax.stream.schedule import recomputed_inputs
from megatrain_jax.tools import plan
from megatrain_jax.train.trainers import llama_templates

GiB = 2**30

# The shape test_long_context's split of saved inputs steps with: its programs compile once.
SPLIT = ("model.layers=4", "data.batch_size=4", "data.micro_batches=2")


def _forward_backward(cfg, params, **placement):
    engine = StreamEngine(llama_templates(cfg), optim.build_stream_optimizer(cfg),
                          micro_batches=cfg.data.micro_batches, **placement)
    tracer = Transfers()
    loss, grads, sq, _, _ = engine.forward_backward(engine.state_from_params(params).params,
                                                    TokenSource(cfg).batch_at(0),
                                                    tracer=tracer)
    return float(loss), jax.tree.map(np.asarray, grads), float(sq), tracer.h2d


def test_recomputed_inputs_give_the_same_gradients_and_fetch_what_they_recompute():
    """The same loss and gradients as every input saved, bit for bit (the recompute is the
    forward's program on the forward's input); each recomputed run fetches the weights of
    the layers it runs again, and a saved input on the host once, not twice."""
    cfg = tiny(*SPLIT)
    params = model.init(cfg.model, jax.random.key(0))
    loss, grads, sq, h2d = _forward_backward(cfg, params)
    assert h2d[-4:] == ["layer 3", "layer 2", "layer 1", "layer 0"]
    cases = {  # placement: the backward's transfers
        (("recompute_inputs", 1),): ["layer 2", "layer 3", "layer 2", "layer 1", "layer 0"],
        (("recompute_inputs", 3), ("saved_inputs", "pinned_host")):
            ["input 0", "layer 0", "layer 1", "layer 2", "layer 3", "layer 2", "layer 1",
             "layer 0"],
        (("recompute_inputs", 2), ("saved_inputs", 2), ("keep_weights", 2)):
            ["input 0", "layer 0", "layer 1", "layer 0"],
    }
    for placement, transfers in cases.items():
        got = _forward_backward(cfg, params, **dict(placement))
        assert got[0] == loss and got[2] == sq, placement
        assert max_rel_error(got[1], grads) == 0.0, placement
        assert got[3][got[3].index("head") + 1:] == transfers, placement


def test_recomputed_layers_are_spread_and_refused_beyond_the_plain_layers():
    assert recomputed_inputs(32, 0) == frozenset()
    assert recomputed_inputs(4, 2) == {1, 3}
    assert recomputed_inputs(32, 4) == {7, 15, 23, 31}  # runs of 2 among runs of 1
    assert recomputed_inputs(5, 4) == {1, 2, 3, 4}
    with pytest.raises(ValueError, match=r"recompute_inputs \(4\) must leave a saved input "
                                         r"among the 4 layers .* at most 3"):
        recomputed_inputs(4, 4)


def test_a_step_recomputing_inputs_trains_as_the_reference_with_clipping():
    """conftest.CLIPPED with its last two layers' inputs recomputed from layer 0's, which
    waits on the host; layer 0 resident (no fetch), layer 1 streamed (fetched again): steps
    clipped (norms above 1.5 from the fourth) and not, equal to the reference."""
    cfg = tiny(*CLIPPED, "stream.update=host", "stream.resident_layers=1",
               "stream.saved_inputs=pinned_host", "stream.recompute_inputs=2",
               "optim.clip_norm=1.5")
    stream, _ = agrees_with_reference_while_clipping(cfg, 6)
    assert stream.engine.schedule.recompute_inputs == 2
    assert memory.plan_of(stream.cfg).recomputed_inputs == 2


def test_the_closed_form_counts_the_schedules_layers():
    """planning/recompute.py's counts over arrays against the layers the schedule picks."""
    configs = {layers: tiny(f"model.layers={layers}") for layers in range(1, 8)}
    for layers, saving, attention, resident, weights, host in itertools.product(
            range(1, 8), range(3), range(3), range(4), range(3), range(9)):
        plain = max(0, layers - saving - attention)
        if saving + attention > layers or weights > layers - saving - resident:
            continue
        for d in range(max(plain, 1)):
            plan = PlacementPlan(resident, False, saving, attention, weights, host, d)
            cfg = configs[layers]
            dropped = recomputed_inputs(plain, d)
            saves = [i for i in range(layers - saving) if i not in dropped]
            assert recompute.host_saved(cfg, plan) == len([i for i in saves if i < host])
            starts = [i for i in range(plain) if i not in dropped]
            runs = [b - a for a, b in zip(starts, [*starts[1:], plain])]
            assert recompute.longest_run(plan, plain) == max(runs, default=0)
            kept = range(layers - saving - weights, layers - saving)
            again = [k for k in range(plain) if k + 1 in dropped and k >= resident
                     and k not in kept]
            assert recompute.fetched_again(cfg, plan) == len(again), (plan, dropped)


def test_plan_accepts_7b_at_524288_on_the_h200_box(capsys):
    """4 GiB of saved input a layer: every input saved, the host cannot hold them beside the
    fp32 state (tests/test_long_context.py); the planner recomputes the fewest that let it,
    and the step it expects carries one more layer forward for each."""
    args = ["data.batch_size=1", "data.seq_len=524288", "model.max_seq_len=524288"]
    assert main(["plan", "7b", *args, "--host-gb", "125", "--gpu-gb", "140"]) == 0
    out = capsys.readouterr().out
    cfg = load_config("7b", args)
    est = plan.estimate(cfg, 133 * GiB, 125 * GiB)
    placement = memory.plan_of(est["config"])
    d = placement.recomputed_inputs
    assert 0 < d <= 8 and est["host_total"] <= 125 * GiB
    assert f"host memory: 125.00 GiB, {est['host_total'] / GiB:.2f} GiB needed -> fits" in out
    assert "none: recomputed" in out and f"{d} recomputing their input" in \
        plan.placement_summary(est["config"])
    rates = presets.PRESETS["H200"].rates(cfg)
    saving_all = dataclasses.replace(placement, recomputed_inputs=0)
    with_d, without = (roofline.bound_of(cfg, p, rates, 1) for p in (placement, saving_all))
    assert with_d["compute_backward_s"] - without["compute_backward_s"] == pytest.approx(
        d * rates.layer_forward_s)
    assert with_d["step_s"] > without["step_s"] + 0.9 * d * rates.layer_forward_s
    planned = planner.plan_placement(cfg, 133 * GiB, 125 * GiB, 1, rates)
    assert planned.plan == placement and planned.clipping_s == pytest.approx(with_d["step_s"])
