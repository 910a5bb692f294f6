"""The memory planner and the roofline's compute-bound point."""

import argparse
import dataclasses
import json
import math
import os
import re
import time

import pytest

from megatrain_jax.cli import main
from megatrain_jax.config import ConfigError, load_config, shipped_configs
from megatrain_jax.planning import memory, planner, presets, roofline, staging
from megatrain_jax.planning.memory_lines import placement_lines
from megatrain_jax.tools import measure, plan

GiB = 2**30
# Rates measured on the H200 for 7b at 16 x 1024 tokens, without the host memory's
# bandwidth: a benchmark JSON as `plan --rates` reads it.
RATES_7B = {"h2d_gbps": 53.28376885968488, "d2h_gbps": 53.33238465561888,
            "layer_forward_s": 0.010479104000012285, "layer_backward_s": 0.028915388000001485,
            "head_s": 0.05402032800000711, "optimizer_gparams": 6.045185168568684,
            "overlapped_update": True}


def streamed(cfg):
    """cfg with every part streamed and nothing kept on the GPU, every placement key pinned:
    the bound's and the traffic's arithmetic at a known placement."""
    return planner.pinned_config(cfg, memory.PlacementPlan())


def test_check_fits_refuses_with_the_numbers():
    cfg = load_config("7b", ["data.batch_size=16", "data.seq_len=1024"])
    on_gpu = memory.replaced(memory.replaced(cfg, "stream", saved_inputs="device"), "loop",
                             final_checkpoint=False, stop_save=False)  # no staging area
    # A 16 GiB GPU holds the step and its saved inputs but no state: all of it on the host,
    # which 7b with bf16 layer gradients (stream.grad_dtype=auto) measured at 96.1 GiB at peak
    # in a run that did not save, its moments pinned (planned 96.3): beside the pool now, they
    # carry none of its bookkeeping (1/32 of their 50 GiB).
    with pytest.raises(ConfigError, match=r"needs 97.9 GiB of host memory .* GPU holds 0 of "
                                          r"its 32 layers.* only 64.0 GiB"):
        plan.check_fits(on_gpu, host=64 * GiB, gpu=16 * GiB)
    # An 80 GiB GPU takes enough of the state (resident layers) for the 64 GiB host.
    plan.check_fits(cfg, host=64 * GiB, gpu=80 * GiB)
    est = plan.estimate(cfg, 80 * GiB, 64 * GiB)
    assert memory.plan_of(est["config"]).resident_layers > 0
    assert est["host_total"] <= 64 * GiB and est["device_total"] <= 80 * GiB - memory.HEADROOM
    # Weights (2.26 GiB) and gradients (1.51) in flight, the fetched embedding (0.49), the
    # layer's working set (3.89), every saved input (4.0) and the headroom (3).
    with pytest.raises(ConfigError, match=r"needs at least 15.1 GiB of GPU memory with nothing "
                                          r"resident, but the GPU budget is 14.0 GiB"
                                          r".*Changes that fit: stream.saved_inputs=auto;"):
        plan.check_fits(on_gpu, host=125 * GiB, gpu=14 * GiB)
    plan.check_fits(cfg, host=125 * GiB, gpu=14 * GiB)  # auto: some inputs to the host
    assert memory.plan_of(plan.estimate(cfg, 14 * GiB, 125 * GiB)["config"]).host_inputs > 0
    plan.check_fits(cfg, host=125 * GiB, gpu=139 * GiB)  # the H200 machine: fits
    # Micro-batches shrink the step's workspace.
    split = load_config("7b", ["data.batch_size=16", "data.seq_len=1024",
                               "data.micro_batches=4"])
    assert plan.estimate(split)["device_total"] < plan.estimate(cfg)["device_total"]


@pytest.mark.parametrize("overrides, host_gib, gpu_gib", [
    (["data.batch_size=16", "data.seq_len=1024", "stream.saved_inputs=device"], 125, 14),
    (["data.batch_size=16", "data.seq_len=1024", "stream.saved_inputs=device"], 125, 15),
    (["data.batch_size=16", "data.seq_len=1024"], 125, 10),
    (["data.batch_size=1", "data.seq_len=524288", "stream.recompute_inputs=off"], 125, 140),
    (["data.batch_size=1", "data.seq_len=65536", "stream.saved_inputs=pinned_host",
      "stream.grad_dtype=float32", "stream.recompute_inputs=off"], 15, 140),
    (["data.batch_size=1", "data.seq_len=65536", "stream.saved_inputs=pinned_host",
      "stream.grad_dtype=float32", "stream.resident_layers=0"], 100, 140),
    (["data.batch_size=2", "data.seq_len=16384", "model.attention=xla"], 125, 40),
])
def test_every_change_a_refusal_names_fits(overrides, host_gib, gpu_gib):
    args = ["7b", "model.max_seq_len=524288", *overrides]
    host, gpu = host_gib * GiB, gpu_gib * GiB
    with pytest.raises(ConfigError, match="Changes that fit: ") as refused:
        plan.check_fits(load_config(args[0], args[1:]), host=host, gpu=gpu)
    changes = str(refused.value).split("Changes that fit: ")[1].rstrip(".").split("; ")
    assert changes
    for change in changes:
        plan.check_fits(load_config(args[0], [*args[1:], *change.split()]), host=host, gpu=gpu)


@pytest.mark.parametrize("host_gib", [16, 125, 600, 2000])
def test_largest_fitting_is_the_largest_shipped_shape_that_fits(host_gib):
    cfg = load_config("7b", ["data.batch_size=16", "data.seq_len=1024"])
    host, gpu = host_gib * GiB, 139 * GiB
    found = plan.largest_fitting(cfg, host, gpu)
    sizes = {}
    for name, path in shipped_configs().items():
        candidate = dataclasses.replace(cfg, model=load_config(str(path)).model)
        est = plan.estimate(candidate, gpu, host)  # placed for this host and GPU
        fits = est["refused"] is None
        assert not fits or (est["host_total"] <= host
                            and est["device_total"] <= gpu - memory.HEADROOM)
        sizes[name] = (candidate.model.num_params, fits)
    fitting = [n for n, (_, fits) in sizes.items() if fits]
    assert found is not None and found[0] in fitting
    assert sizes[found[0]][0] == max(sizes[n][0] for n in fitting)
    assert found[1].data == cfg.data  # the user's settings, another shape
    if host_gib == 125:
        # The H200's GPU holds most of 14b's layers (13.0B) and their state: the largest
        # that fits the 125 GiB box; 30b (32.5B) does not.
        assert found[0] == "14b"
    assert plan.largest_fitting(cfg, 1024, gpu) is None


def test_largest_fitting_splits_saved_inputs_by_the_gpu_it_is_given():
    """120b at 64 x 1024 holds 135 GiB of saved inputs, more than the GPU: auto sends some to
    the host, and the search for the largest shape must split them as the verdict does."""
    cfg = load_config("120b", ["data.batch_size=64"])
    host, gpu = 2048 * GiB, 133 * GiB
    est = plan.estimate(cfg, gpu)
    assert est["host"]["saved_inputs"] > 0 and est["device_total"] <= gpu
    assert plan.largest_fitting(cfg, host, gpu)[0] == "120b"


def test_compute_bound_tokens_is_where_compute_outlasts_transfers_and_updates():
    cfg = load_config("7b")
    rates = roofline.Rates(h2d_gbps=50, d2h_gbps=50, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=5.0)
    tokens = roofline.compute_bound_tokens(cfg.model, rates, 16384)

    def compute_bound(t):
        b = roofline.bound(cfg.model, presets.scaled(rates, t / 16384))
        paced = max(b["h2d_per_pass_s"], b["optimizer_s"])
        return b["compute_forward_s"] >= paced * (1 - 1e-9) and \
            b["compute_backward_s"] >= max(b["h2d_per_pass_s"], b["d2h_s"]) * (1 - 1e-9)

    assert compute_bound(tokens) and not compute_bound(int(tokens * 0.95))
    # With the update on the device the forward is no longer paced by the optimizer.
    serial = dataclasses.replace(rates, overlapped_update=False)
    assert roofline.compute_bound_tokens(cfg.model, serial, 16384) < tokens
    # The embedding and head on the GPU: the host's share, and so the pace, is smaller.
    assert roofline.compute_bound_tokens(cfg.model, rates, 16384,
                                         resident_embeddings=True) < tokens
    # Where the backward's weight fetches pace it, layers that keep their forward's weights
    # fetch none: half the layers keeping them, half the fetches.
    fetching = roofline.Rates(h2d_gbps=50, d2h_gbps=1000, layer_forward_s=0.02,
                              layer_backward_s=0.004, head_s=0.05, optimizer_gparams=50.0,
                              overlapped_update=False)
    every = roofline.compute_bound_tokens(cfg.model, fetching, 16384)
    half = roofline.compute_bound_tokens(cfg.model, fetching, 16384, kept_layers=16)
    b = roofline.bound(cfg.model, fetching, kept_layers=16)
    assert b["h2d_backward_s"] == pytest.approx(
        b["h2d_per_pass_s"] * (1 - 16 * cfg.model.params_per_layer
                               / roofline.streamed_params(cfg.model)))
    assert half < every and half == pytest.approx(
        every * b["h2d_backward_s"] / b["h2d_per_pass_s"], rel=1e-3)


def test_plan_command_shows_components_fit_and_compute_bound_point(capsys, monkeypatch,
                                                                   tmp_path):
    monkeypatch.setattr(plan, "host_memory_available", lambda: 125 * GiB)
    monkeypatch.setattr(plan, "gpu_memory_bytes", lambda: 139 * GiB)
    rates_file = tmp_path / "bench.json"
    rates_file.write_text(json.dumps({"roofline": RATES_7B, "tokens_per_step": 16384}))
    # Some layers streamed (pinned: at these rates the whole model would be resident).
    assert main(["plan", "7b", "data.batch_size=16", "data.seq_len=1024",
                 "stream.resident_layers=24", "--rates", str(rates_file)]) == 0
    out = capsys.readouterr().out
    rates = roofline.Rates.from_result(RATES_7B)
    # Placed as `train` places it on this machine, at the rates of the file.
    est = plan.estimate(load_config("7b", ["stream.resident_layers=24"]),
                        plan.usable_gpu_bytes(139 * GiB), 125 * GiB, rates)
    cfg, gib = est["config"], lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
    for part in ("master_weights", "optimizer_state", "gradients", "pinned host pool",
                 "saved_inputs", "workspace", "resident_layers",
                 f"host memory: 125.00 GiB, {gib(est['host_total'])} needed -> fits",
                 f"GPU memory: 132.05 GiB of 139.00 GiB (XLA's share), "
                 f"{gib(est['device_total'])} needed -> fits",
                 "largest shipped shape that fits this machine (host and GPU together): 14b",
                 "layer gradients to the host in bfloat16 (stream.grad_dtype=auto)",
                 *placement_lines(cfg)):
        assert part in out, part
    placement = memory.plan_of(cfg)
    assert placement.resident_layers > 0  # the GPU's room holds state
    share, step_s = roofline.best_speculate_share(cfg, rates)  # stream.speculate=auto
    clip_s = roofline.bound_of(cfg, placement, rates, 1)["step_s"]
    assert f"step bound: {step_s:.3f} s ({16384 / step_s:,.0f} tokens/s) where steps do not " \
        f"clip, {clip_s:.3f} s ({16384 / clip_s:,.0f} tokens/s) where they clip" in out
    assert step_s <= clip_s
    # The placement beats streaming every part: its bound is the smaller.
    assert step_s < roofline.bound_for(streamed(cfg), rates)["step_s"]
    # At these rates the layers' compute is the largest single cost.
    assert "the largest cost: compute" in out
    # The host holds the streamed layers only: their compute outlasts the paced stream from
    # fewer tokens than a step has.
    tokens = roofline.compute_bound_tokens(
        cfg.model, rates, 16384, placement.resident_layers, placement.resident_embeddings,
        placement.unfetched(cfg.model.layers), placement.saving_layers)
    assert f"compute-bound from about {tokens:,} tokens" in out and 0 < tokens < 16384


@pytest.fixture
def small_samples(monkeypatch):
    """The rate measurement on smaller samples than a real machine's (the same code)."""
    from megatrain_jax.train import machine

    monkeypatch.setattr(plan, "OPTIMIZER_SAMPLE", 8 * 2**20)
    sized = machine.memory_gbps
    monkeypatch.setattr(machine, "memory_gbps",
                        lambda **kw: sized(**{"window_s": 0.1, **kw, "mfloats": 32}))


def test_the_shared_bandwidth_counts_the_transfer_beside_the_kernel():
    """memory_gbps(beside=(move, nbytes)) adds the bytes of every move that ended within the
    kernel's window: here up to twenty 1 TB "moves" in 0.2 s, so that even one of them, on a
    loaded machine, lifts the rate far above what the kernel alone can vary by."""
    from megatrain_jax.train import machine

    alone = machine.memory_gbps(mfloats=8)
    moves = []

    def move():
        time.sleep(0.01)
        moves.append(1)

    shared = machine.memory_gbps(mfloats=8, beside=(move, 10**12), window_s=0.2)
    assert moves and alone > 0
    assert shared > alone + 1000


def test_plan_measure_on_this_machine(capsys, small_samples):
    # Measured on two streamed layers whatever the run keeps on the GPU.
    assert main(["plan", "tiny", "model.layers=3", "stream.resident_layers=3", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "rates (measured here): H2D" in out and "compute-bound from about" in out
    assert float(re.search(r"host memory (\S+) GB/s", out)[1]) > 0
    assert "step bound: " in out and re.search(r"0-2 \(3\) +resident", out)


def test_the_link_is_timed_from_pinned_host_memory_with_resident_layers(small_samples):
    import jax

    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.train import StreamTrainer

    trainer = StreamTrainer(load_config("tiny", ["model.layers=3", "stream.resident_layers=2"]))
    cfg = trainer.cfg  # placed: the rest of its placement decided
    assert memory.plan_of(cfg).resident_layers == 2
    state = trainer.init(jax.random.key(0))
    place, kinds = trainer.engine.placement, []
    to_device = place.to_device

    def recording(tree, copy=False):
        kinds.extend(a.sharding.memory_kind for a in jax.tree.leaves(tree)
                     if isinstance(a, jax.Array))
        return to_device(tree, copy)

    place.to_device = recording
    measured = measure.measure(cfg, trainer.engine, state, TokenSource(cfg).batch_at(0))
    assert kinds and set(kinds) == {"pinned_host"}  # never a no-op device -> device "copy"
    assert measured["h2d_gbps"] > 0


def test_train_refuses_a_model_that_does_not_fit(capsys, monkeypatch):
    monkeypatch.setattr(plan, "host_memory_available", lambda: 8 * GiB)
    assert main(["train", "7b", "loop.steps=1"]) == 2
    assert "GiB of host memory" in capsys.readouterr().err


def test_the_head_is_serial_in_the_step_bound():
    """The head needs its own update and the last layer's output, and the backward starts
    from its gradient: more head time is more step time, even when the optimizer paces the
    forward and would hide it under a max."""
    cfg = load_config("7b")
    rates = roofline.Rates(h2d_gbps=50, d2h_gbps=50, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=4.0)
    for overlapped in (True, False):
        base = dataclasses.replace(rates, overlapped_update=overlapped)
        b = roofline.bound(cfg.model, base)
        assert b["optimizer_s"] > b["compute_forward_s"]  # the update paces the forward
        longer = roofline.bound(cfg.model, dataclasses.replace(base, head_s=0.15))
        assert longer["step_s"] - b["step_s"] == pytest.approx(0.1)
        assert b["step_s"] >= b["optimizer_s"] + b["compute_head_s"] + b["compute_backward_s"]


def test_host_memory_traffic_bounds_each_phase():
    """The update and the weight pass share the host's memory in the forward, the weight pass
    and the gradients in the backward: a phase lasts at least its bytes over that bandwidth."""
    cfg = load_config("7b")
    p = cfg.model.num_params
    rates = roofline.Rates(h2d_gbps=50, d2h_gbps=50, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=4.0)
    unknown = roofline.bound(cfg.model, rates)  # no bandwidth measured: no such term
    assert unknown["host_memory_forward_s"] == unknown["host_memory_backward_s"] == 0
    slow = roofline.bound(cfg.model, dataclasses.replace(rates, host_memory_gbps=100))
    forward_s = (roofline.HOST_UPDATE_BYTES + 4) * p / 100e9
    assert slow["host_memory_forward_s"] == pytest.approx(forward_s)
    assert forward_s > unknown["optimizer_s"]  # 32 bytes at 100 GB/s outlast 4 G params/s
    assert slow["step_s"] - unknown["step_s"] == pytest.approx(forward_s - unknown["optimizer_s"])
    # Slow enough, the backward's 8 bytes per parameter outlast its compute too.
    slower = roofline.bound(cfg.model, dataclasses.replace(rates, host_memory_gbps=40))
    backward_s = 8 * p / 40e9
    assert backward_s > slower["compute_backward_s"]
    assert slower["step_s"] == pytest.approx(
        (roofline.HOST_UPDATE_BYTES + 4) * p / 40e9 + rates.head_s + backward_s)
    assert slower["limited_by"] == "host_memory"
    # An update on the device moves its bytes over the link, not through the host's update.
    serial = roofline.bound(cfg.model, dataclasses.replace(rates, host_memory_gbps=100,
                                                           overlapped_update=False))
    assert serial["host_memory_forward_s"] == pytest.approx(4 * p / 100e9)


def test_transfers_beside_the_host_update_slow_it_while_they_run():
    """An update that outlasts the weight pass loses `update_loss_h2d` of each of its
    seconds; one that ends first runs slowed throughout; the backward's share loses to both
    transfers. A device update is serial and loses nothing to them."""
    cfg = load_config("7b", ["stream.grad_dtype=float32"])
    rates = roofline.Rates(h2d_gbps=50, d2h_gbps=50, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=4.0)
    plain = roofline.bound(cfg.model, rates, speculate=0.5)
    lossy = dataclasses.replace(rates, update_loss_h2d=0.3, update_loss_d2h=0.2)
    b = roofline.bound(cfg.model, lossy, speculate=0.5)
    half, weights, grads = 0.5 * plain["optimizer_s"], b["h2d_per_pass_s"], b["d2h_s"]
    assert half / 0.7 > weights  # the slowed update outlasts the weight pass
    assert plain["update_forward_s"] == pytest.approx(half)
    assert b["update_forward_s"] == pytest.approx(half + 0.3 * weights)
    assert b["update_backward_s"] == pytest.approx(half + 0.3 * weights + 0.2 * grads)
    assert b["step_s"] > plain["step_s"]
    short = roofline.bound(cfg.model, dataclasses.replace(lossy, optimizer_gparams=400.0),
                           speculate=0.5)
    assert short["update_forward_s"] == pytest.approx(0.5 * short["optimizer_s"] / 0.7)
    serial = roofline.bound(cfg.model, dataclasses.replace(lossy, overlapped_update=False))
    assert serial["step_s"] == pytest.approx(roofline.bound(
        cfg.model, dataclasses.replace(rates, overlapped_update=False))["step_s"])
    assert serial["update_forward_s"] == serial["update_backward_s"] == 0
    # The update paces the forward here, so the compute-bound point moves out with it.
    tokens = roofline.compute_bound_tokens(cfg.model, rates, 16384)
    assert roofline.compute_bound_tokens(cfg.model, lossy, 16384) == pytest.approx(
        tokens * (plain["optimizer_s"] + 0.3 * weights) / plain["optimizer_s"], rel=1e-3)


def test_the_update_moves_the_bytes_of_its_moments():
    """fp32 moments: 28 bytes per parameter through host memory; bf16 moments 20; int8
    about 16 (a byte and a share of a block's scale per moment, each way); bf16 gradients 2
    fewer. The forward's host-memory term carries them."""
    cfg = streamed(load_config("7b", ["stream.grad_dtype=float32", "stream.speculate=off"]))
    per_mode = {mode: roofline.update_bytes(memory.replaced(cfg, "optim", state_dtype=mode))
                for mode in ("float32", "bfloat16", "int8")}
    assert per_mode == {"float32": 28, "bfloat16": 20,
                        "int8": pytest.approx(16 + 16 / 256)}
    bf16_grads = memory.replaced(cfg, "stream", grad_dtype="bfloat16")
    assert roofline.update_bytes(bf16_grads) == pytest.approx(28 - 2 * (
        bf16_grads.model.layers * bf16_grads.model.params_per_layer) / cfg.model.num_params)
    rates = roofline.Rates(h2d_gbps=50, d2h_gbps=50, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=4.0,
                           host_memory_gbps=100)
    p = cfg.model.num_params
    for mode, nbytes in per_mode.items():
        b = roofline.bound_for(memory.replaced(cfg, "optim", state_dtype=mode), rates)
        assert b["host_memory_forward_s"] == pytest.approx((nbytes + 4) * p / 100e9)


def test_a_speculated_update_moves_its_time_to_the_backward():
    """All of the update beside the backward: its bytes and time sit there; the forward
    keeps the weight pass; layer 0's update follows the last gradient."""
    cfg = streamed(load_config("7b", ["stream.speculate=on", "stream.grad_dtype=float32"]))
    p, layer = cfg.model.num_params, cfg.model.params_per_layer
    rates = roofline.Rates(h2d_gbps=50, d2h_gbps=50, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=4.0,
                           host_memory_gbps=100)
    b = roofline.bound(cfg.model, rates, grad_bytes=4, speculate=1.0)
    assert b["host_memory_forward_s"] == pytest.approx(4 * p / 100e9)
    assert b["host_memory_backward_s"] == pytest.approx((4 + 4 + 28) * p / 100e9)
    forward = max(b["compute_forward_s"], b["h2d_per_pass_s"], b["host_memory_forward_s"])
    backward = max(b["compute_backward_s"], b["d2h_s"], b["optimizer_s"],
                   b["host_memory_backward_s"])
    assert b["step_s"] == pytest.approx(forward + rates.head_s + backward + layer / 4e9)
    # Off, the schedule is the usual one; with the update on the device, speculating is too.
    off = streamed(load_config("7b", ["stream.grad_dtype=float32", "stream.speculate=off"]))
    usual = roofline.bound_for(off, rates)
    assert usual["host_memory_forward_s"] == pytest.approx((28 + 4) * p / 100e9)
    serial = dataclasses.replace(rates, overlapped_update=False)
    assert roofline.bound_for(cfg, serial)["step_s"] == \
        roofline.bound_for(off, serial)["step_s"]


def test_a_speculating_step_takes_the_best_share_of_the_update_beside_the_backward():
    """A share f of the update beside the backward: f of its bytes and time there, the rest
    beside the forward. A step that speculates drops the speculative updates still queued when the
    backward ends, so its bound is that of the best share (up to stream.speculate_share):
    the one that fills the backward's spare host memory."""
    fp32_grads = ["stream.grad_dtype=float32"]
    cfg = streamed(load_config("7b", fp32_grads))  # stream.speculate=auto, the default
    p = cfg.model.num_params
    rates = roofline.Rates(h2d_gbps=50, d2h_gbps=50, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=4.0,
                           host_memory_gbps=100)
    quarter = roofline.bound(cfg.model, rates, grad_bytes=4, speculate=0.25)
    assert quarter["host_memory_forward_s"] == pytest.approx((4 + 0.75 * 28) * p / 100e9)
    assert quarter["host_memory_backward_s"] == pytest.approx((4 + 4 + 0.25 * 28) * p / 100e9)
    share, seconds = roofline.best_speculate_share(cfg, rates)
    # The backward's 0.96 s of compute leave the host memory room for 0.96 * 100e9 / p bytes
    # a parameter, 8 of which the weights and gradients take: the share that fills it.
    room = (32 * 0.03 * 100e9 / p - 8) / 28
    assert share == pytest.approx(math.ceil(room * 20) / 20) and 0 < share < 1
    assert roofline.bound_for(cfg, rates)["step_s"] == seconds
    assert seconds < roofline.bound(cfg.model, rates, grad_bytes=4, speculate=1.0)["step_s"]
    off = streamed(load_config("7b", [*fp32_grads, "stream.speculate=off"]))
    assert seconds < roofline.bound_for(off, rates)["step_s"]
    capped = streamed(load_config("7b", [*fp32_grads, "stream.speculate_share=0.1"]))
    assert roofline.bound_for(capped, rates)["step_s"] == pytest.approx(
        roofline.bound(cfg.model, rates, grad_bytes=4, speculate=0.1)["step_s"])


def test_measured_host_memory_is_at_least_what_the_update_moved(small_samples):
    from megatrain_jax.tools.measure import measure_rates

    rates = measure_rates(load_config("tiny"))
    assert rates.overlapped_update
    assert rates.host_memory_gbps >= rates.optimizer_gparams * roofline.HOST_UPDATE_BYTES > 0
    assert 0 <= rates.update_loss_h2d < 1 and 0 <= rates.update_loss_d2h < 1


def test_plan_measure_sizes_the_pinned_pool_for_the_layers_it_streams(monkeypatch):
    """`plan --measure` streams two of the model's layers whatever the planner keeps on the
    GPU: the pool it sets before JAX starts holds their state and the measurement's copies
    (7b on the H200 places every layer on the GPU, which leaves the run's pool small)."""
    from megatrain_jax.tools import plan_report

    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    monkeypatch.setattr(plan, "host_memory_available", lambda: 125 * GiB)
    monkeypatch.setattr(plan, "gpu_memory_bytes", lambda: 139 * GiB)
    monkeypatch.setattr(measure, "measure_rates", lambda cfg: RATES_7B)
    args = argparse.Namespace(rates=None, measure=True)
    assert plan_report._plan_rates(args, load_config("7b"))[0] is RATES_7B
    small = measure.measured_config(load_config("7b"))
    held = plan.pinned_bytes(small) + plan.measurement_bytes(small)
    assert memory.plan_of(small).resident_layers == 0
    assert int(os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]) * GiB >= held


def test_bf16_layer_gradients_halve_their_host_bytes_and_traffic():
    fp32 = streamed(load_config("7b", ["stream.grad_dtype=float32"]))
    half = streamed(load_config("7b", ["stream.grad_dtype=bfloat16"]))  # layer grads in bf16
    # auto: bf16 where they are bf16 values (bf16 compute, one micro-batch, one device).
    assert plan.estimate(streamed(load_config("7b")))["host"] == plan.estimate(half)["host"]
    for fp32_values in (["data.micro_batches=2"], ["model.compute_dtype=float32"]):
        assert roofline.gradient_bytes(streamed(load_config("7b", fp32_values))) == 4
    assert roofline.gradient_bytes(streamed(load_config("7b")), devices=2) == 4
    # Unsaid, the devices are the run's: a mesh's gradients are fp32 sums, read by the update.
    assert roofline.gradient_bytes(streamed(load_config("7b", ["mesh.data=2"]))) == 4
    assert roofline.update_bytes(streamed(load_config("7b", ["mesh.data=2"]))) == 28
    layer_params = half.model.layers * half.model.params_per_layer
    saved = plan.estimate(fp32)["host"]["gradients"] - plan.estimate(half)["host"]["gradients"]
    assert saved == pytest.approx(2 * layer_params, abs=1)
    assert roofline.gradient_bytes(fp32) == 4
    assert roofline.gradient_bytes(streamed(load_config(
        "7b", ["data.micro_batches=2", "stream.grad_dtype=bfloat16"]))) == 4
    rates = roofline.Rates(h2d_gbps=50, d2h_gbps=50, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=4.0,
                           host_memory_gbps=150)
    grad_bytes = roofline.gradient_bytes(half)
    a, b = roofline.bound(half.model, rates), roofline.bound(half.model, rates,
                                                             grad_bytes=grad_bytes)
    assert b["d2h_s"] == pytest.approx(a["d2h_s"] * grad_bytes / 4)
    per_byte = half.model.num_params / 150e9
    assert a["host_memory_backward_s"] - b["host_memory_backward_s"] == pytest.approx(
        (4 - grad_bytes) * per_byte)
    assert a["host_memory_forward_s"] - b["host_memory_forward_s"] == pytest.approx(
        (4 - grad_bytes) * per_byte)


def test_resident_layers_move_their_state_from_the_host_to_the_gpu_in_the_plan_and_bound():
    fp32_grads = ["data.batch_size=16", "data.seq_len=1024", "stream.grad_dtype=float32"]
    base = load_config("7b", fp32_grads)
    cfg = load_config("7b", [*fp32_grads, "stream.resident_layers=8"])
    moved = 8 * cfg.model.params_per_layer
    before, after = plan.estimate(base), plan.estimate(cfg)  # a GPU of unknown room (the CPU)
    assert memory.plan_of(before["config"]) == memory.PlacementPlan()  # nothing on the GPU
    assert memory.plan_of(after["config"]) == memory.PlacementPlan(resident_layers=8)
    # Weights, two moments and gradients, and the pool's bookkeeping for them (the pool is
    # sized in whole GiB: its margin takes up the rounding).
    assert before["host_total"] - after["host_total"] == pytest.approx(
        16 * moved * (1 + plan.POOL_BOOKKEEPING), abs=1.1 * GiB)
    # On the GPU their weights and moments, and their fp32 gradients (held from the backward
    # to the update) where these outgrow the saved inputs the backward has let go by then.
    device = after["device"]
    assert device["resident_layers"] == 12 * moved
    assert device["saved_inputs"] == before["device"]["saved_inputs"] > 0
    assert device["resident_gradients"] == 4 * moved - device["saved_inputs"] > 0
    assert after["device_total"] - before["device_total"] == 16 * moved - device["saved_inputs"]
    rates = roofline.Rates(h2d_gbps=50, d2h_gbps=50, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=4.0,
                           host_memory_gbps=150)
    streamed = roofline.bound(cfg.model, rates)
    resident = roofline.bound(cfg.model, rates, resident_layers=8)
    share = (cfg.model.num_params - moved) / cfg.model.num_params
    for key in ("h2d_per_pass_s", "d2h_s", "optimizer_s", "host_memory_forward_s"):
        assert resident[key] == pytest.approx(streamed[key] * share), key
    assert resident["compute_forward_s"] == streamed["compute_forward_s"]
    assert resident["step_s"] < streamed["step_s"]
    # The GPU's share is refused with the option named when it does not fit: compact
    # moments shrink the resident layers' state, and the planner places fewer.
    everything = load_config("7b", ["stream.resident_layers=32"])
    with pytest.raises(ConfigError, match="needs at least 93.8 GiB of GPU memory.* Changes "
                       "that fit: optim.state_dtype=bfloat16; stream.resident_layers=auto."):
        plan.check_fits(everything, host=125 * GiB, gpu=80 * GiB)
    with pytest.raises(ConfigError, match="Changes that fit: stream.resident_layers=auto."):
        plan.check_fits(everything, host=125 * GiB, gpu=40 * GiB)


@pytest.mark.parametrize("resident", [0, 16, 32])
def test_the_pinned_pool_holds_the_state_and_the_rate_measurement(resident):
    """bench_step and plan --measure pin copies of layers and an optimizer sample beside the
    host state, whatever stream.resident_layers leaves on the host."""
    cfg = load_config("7b", [f"stream.resident_layers={resident}"])
    state = plan.estimate(cfg)["pool_state"]
    sampled = 4 * plan.MEASURED_LAYERS * cfg.model.params_per_layer + 16 * plan.OPTIMIZER_SAMPLE
    assert plan.measurement_bytes(cfg) == sampled
    assert plan.pinned_pool_bytes(cfg, measuring=True) >= state + sampled
    # A run that does not measure asks for the state and a margin only, in the whole GiB of
    # its cap: the pool is resident.
    assert plan.pinned_pool_bytes(cfg) == plan.pool_limit_gib(cfg, state) * GiB
    assert 0 < plan.pinned_pool_bytes(cfg) - (state + plan.POOL_MARGIN) <= GiB


def test_a_refusal_names_the_compact_state_that_fits(capsys):
    """14b's fp32 state does not fit a 125 GiB host beside a 20 GiB GPU (which holds a few of
    its layers); int8 moments with bf16 layer gradients (the default where exact) do, and the
    refusal names them; with fp32 gradients asked for, int8 alone names bf16 gradients."""
    box = ["--host-gb", "125", "--gpu-gb", "20"]
    assert main(["plan", "14b", *box]) == 1
    assert "Changes that fit: optim.state_dtype=int8." in capsys.readouterr().err
    assert main(["plan", "14b", "optim.state_dtype=int8", "stream.grad_dtype=float32",
                 *box]) == 1
    assert "Changes that fit: stream.grad_dtype=bfloat16." in capsys.readouterr().err
    assert main(["plan", "14b", "optim.state_dtype=int8", *box]) == 0
    out = capsys.readouterr().out
    modes = plan.host_bytes_per_param(load_config("14b", ["stream.grad_dtype=bfloat16"]),
                                      plan.usable_gpu_bytes(20 * GiB), 125 * GiB)
    assert list(modes) == ["float32", "bfloat16", "int8"]
    # Two fp32 moments -> bf16 (beside the pinned pool: none of its bookkeeping; whole GiB:
    # +-0.1 B/param); the least staging area is none in either.
    assert modes["float32"] - modes["bfloat16"] == pytest.approx(4, abs=0.1)
    # 4 + 2 + 2.03, the pool's margin and bookkeeping, runtime, less the resident layers', and
    # the staging area's one layer (6.03 bytes a layer parameter: 0.15 a model's)
    assert 8.65 < modes["int8"] < 9.15
    assert f"int8 {modes['int8']:.1f}" in out and f"bfloat16 {modes['bfloat16']:.1f}" in out
    # Without compact moments (Lion), no such change exists.
    lion = load_config("14b", ["optim.name=lion"])
    with pytest.raises(ConfigError, match="lion state"):
        plan.check_fits(lion, host=60 * GiB, gpu=20 * GiB)
    assert not [c for c in plan.fitting_changes(lion, 60 * GiB, 20 * GiB) if "state_dtype" in c]


def test_a_refusal_without_compact_moments_names_no_state_dtype():
    with pytest.raises(ConfigError) as refused:
        plan.check_fits(load_config("14b", ["optim.name=lion"]), host=60 * GiB, gpu=20 * GiB)
    assert "state_dtype" not in str(refused.value)


def test_plan_places_each_form_of_the_state_anew(capsys):
    """`plan`'s host bytes a parameter by optim.state_dtype: each form placed anew, as a run
    in that form would be (host_bytes_per_param of the config as given)."""
    assert main(["plan", "14b", "optim.state_dtype=int8", "--host-gb", "125",
                 "--gpu-gb", "20"]) == 0
    modes = plan.host_bytes_per_param(load_config("14b", ["optim.state_dtype=int8"]),
                                      plan.usable_gpu_bytes(20 * GiB), 125 * GiB)
    assert ", ".join(f"{k} {v:.1f}" for k, v in modes.items()) in capsys.readouterr().out


def test_plan_extrapolates_a_measured_run_to_another_depth(capsys, tmp_path):
    """The 120b width measured at 4 layers: plan gives the full depth's bound and the step
    expected from the measured run's step over its bound; another width is refused."""
    measured = {"roofline": {**RATES_7B, "ratio": 1.25}, "tokens_per_step": 16384,
                "median_step_s": 2.0,
                "config_values": {"model": {"hidden": 10240, "ffn": 28672, "heads": 80,
                                            "kv_heads": 8, "vocab_size": 32000, "layers": 4}}}
    rates_file = tmp_path / "bench.json"
    rates_file.write_text(json.dumps(measured))
    assert main(["plan", "120b", "--host-gb", "2000", "--gpu-gb", "140",
                 "--rates", str(rates_file)]) == 0
    out = capsys.readouterr().out
    rates = roofline.Rates.from_result(RATES_7B)
    gpu, host = plan.usable_gpu_bytes(140 * GiB), 2000 * GiB  # placed as the plan places it
    step_s = roofline.bound_for(plan.resolved(load_config("120b"), gpu, host, rates),
                                rates)["step_s"]
    assert f"step bound: {step_s:.3f} s" in out
    assert f"expected step: {step_s * 1.25:.3f} s ({16384 / (step_s * 1.25):,.0f} tokens/s)" \
        in out and "(4 layers, 16,384 tokens per step, 2.000 s)" in out
    assert main(["plan", "120b", "data.batch_size=64", "--host-gb", "2000", "--gpu-gb", "140",
                 "--rates", str(rates_file)]) == 0
    wide_rates = presets.scaled(rates, 4)
    wide = roofline.bound_for(plan.resolved(load_config("120b", ["data.batch_size=64"]), gpu,
                                            host, wide_rates), wide_rates)["step_s"]
    assert f"expected step: {wide * 1.25:.3f} s" in capsys.readouterr().out
    assert main(["plan", "7b", "--rates", str(rates_file)]) == 2
    assert "measured on a model of another width" in capsys.readouterr().err


def test_the_gpus_counted_are_those_cuda_visible_devices_leaves(monkeypatch):
    """A run on some of a machine's GPUs is planned for those (one GPU: bf16 gradients and
    its pool), not for every GPU nvidia-smi lists."""
    from megatrain_jax.planning import probe

    for visible, count in (("0", 1), ("0,1,2,3", 4), ("2,3", 2), ("", 1)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        probe.gpu_count.cache_clear()
        assert probe.gpu_count() == count
        assert probe.planned_devices(load_config("7b")) == count  # mesh.data=0: all of them
    probe.gpu_count.cache_clear()


def test_each_gpu_of_a_mesh_gets_a_pool_for_its_share_of_the_state():
    """XLA gives each GPU a pinned pool of its own under one cap: a mesh over which the width
    splits caps each at a 1/n share and the margin; one that does not, at the whole."""
    four = load_config("7b", ["mesh.data=4", "data.batch_size=64"])
    pinned = plan.pinned_bytes(four)
    assert plan.pool_limit_gib(four, pinned) == (pinned // 4 + plan.POOL_MARGIN) // GiB + 1
    assert 3 * plan.pool_limit_gib(four, pinned) < pinned // GiB  # a quarter and a margin
    assert plan.pinned_pool_bytes(four) == 4 * plan.pool_limit_gib(four, pinned) * GiB
    host = plan.estimate(four)["host"]
    assert host["pool_margin"] == 4 * plan.pool_limit_gib(four, pinned) * GiB - pinned
    three = load_config("7b", ["mesh.data=3", "data.batch_size=48"])  # 4096 % 3: kept whole
    assert plan.pool_limit_gib(three, pinned) == (pinned + plan.POOL_MARGIN) // GiB + 1


def test_the_host_memory_traffic_of_a_step_grows_over_a_mesh_by_the_fp32_gradients_only():
    """Each GPU of a mesh reads its shard of the weights, so they cross the host's memory once
    as on one GPU; the gradients, sums over the GPUs, are fp32 (written, then read by the
    update) where one GPU's are bf16."""
    one = plan.host_traffic(streamed(load_config("7b", ["mesh.data=1"])))
    four_cfg = streamed(load_config("7b", ["mesh.data=4", "data.batch_size=64"]))
    four = plan.host_traffic(four_cfg)
    assert one["weights"] == four["weights"] == 8
    assert four["gradients"] == 4 and 2 < one["gradients"] < 2.2  # the edges' stay fp32
    assert four["update"] - one["update"] == pytest.approx(four["gradients"] - one["gradients"])
    assert four["update"] == 28  # p, g, mu, nu read; p, mu, nu written
    assert "40.0 bytes a host-held parameter" in plan.traffic_lines(four_cfg)[0]
    device = plan.traffic_lines(streamed(load_config("7b", ["stream.update=device"])))
    assert device[0].startswith("update on the GPU: 14.1 bytes a host-held parameter")


def test_the_bound_over_a_mesh_counts_fp32_gradients():
    """The same rates, one GPU against a mesh: the mesh's gradients are sums (fp32), so its
    gradient traffic and its update's bytes are the larger."""
    rates = roofline.Rates(**{**RATES_7B, "host_memory_gbps": 150.0})
    one_cfg = streamed(load_config("7b", ["mesh.data=1"]))
    one = roofline.bound_for(one_cfg, rates)
    two = roofline.bound_for(streamed(load_config("7b", ["mesh.data=2", "data.batch_size=32"])),
                             rates)
    assert two["d2h_s"] == pytest.approx(one["d2h_s"] * 4 / roofline.gradient_bytes(one_cfg))
    host = lambda b: b["host_memory_forward_s"] + b["host_memory_backward_s"]  # noqa: E731
    assert host(two) == pytest.approx(host(one) * 40.0 / (8 + 2 * roofline.gradient_bytes(
        one_cfg) + 24))


def test_plan_prints_the_pinned_pool_cap_that_train_sets(capsys, monkeypatch):
    """A run that saves pins its save's staging in the same pool: the cap `plan` prints is the
    one `train` sets before JAX starts (set_pool_env), staging included."""
    for name in ("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
    budgets = ["--host-gb", "125", "--gpu-gb", "141"]
    assert main(["plan", "7b", "loop.checkpoint_every=100", *budgets]) == 0
    printed = re.search(r"pinned host pool +([\d.]+) GiB .*and the save's staging; "
                        r"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=(\d+) a GPU", capsys.readouterr().out)
    cfg = plan.resolved(load_config("7b", ["loop.checkpoint_every=100"]),
                        plan.usable_gpu_bytes(141 * GiB), 125 * GiB)
    plan.set_pool_env(cfg)
    cap = int(os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"])
    assert int(printed.group(2)) == cap and float(printed.group(1)) == cap
    captured = staging.staging_pinned_bytes(cfg, 1)  # the GPU's arrays' pinned copies
    assert captured > 50 * GiB and cap * GiB > plan.estimate(cfg)["pool_state"] + captured


def test_a_run_whose_state_is_all_on_the_gpu_counts_no_pinned_pool():
    """3b at the whole H200 keeps every layer, the embedding and the head on the GPU: its
    pinned pool holds nothing and never grows (a run's RSS measured 5.6 GiB, about the
    runtime alone), so the plan counts neither its margin nor its bookkeeping. 7b's does."""
    cfg = load_config("3b")
    def on_h200(cfg):
        return plan.estimate(cfg, plan.usable_gpu_bytes(141 * GiB), 125 * GiB,
                             presets.PRESETS["H200"].rates(cfg, 1))

    all_on_gpu = on_h200(cfg)
    assert all_on_gpu["pool_state"] == 0
    assert all_on_gpu["host"]["pool_margin"] == all_on_gpu["host"]["pool_bookkeeping"] == 0
    assert all_on_gpu["host_total"] - all_on_gpu["host"]["save_staging"] == int(plan.RUNTIME)
    some_on_host = on_h200(load_config("7b"))
    assert some_on_host["pool_state"] > 0 and some_on_host["host"]["pool_margin"] > 0
    assert some_on_host["host"]["pool_bookkeeping"] > 0


def test_a_mesh_that_does_not_divide_the_width_holds_the_state_on_every_gpu():
    """mesh.data=3 with a width of 4096: no weight matrix splits, so each GPU's pool holds the
    whole state, and the plan says so rather than hiding it in the margin."""
    three = load_config("7b", ["mesh.data=3", "data.batch_size=48"])
    host = plan.estimate(three)["host"]
    state = sum(host[name] for name in plan.STATE)  # pinned or not, split alike
    assert host["replicas"] == 2 * state
    assert 0 <= host["pool_margin"] <= 3 * (plan.POOL_MARGIN + GiB)
    assert "replicas" not in plan.estimate(load_config("7b", ["mesh.data=4",
                                                           "data.batch_size=64"]))["host"]
