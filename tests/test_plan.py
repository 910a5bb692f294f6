"""The memory planner and the roofline's compute-bound point."""

import dataclasses
import json
import math
import re
import time

import pytest

from megatrain_jax.cli import main
from megatrain_jax.config import ConfigError, load_config, memory, shipped_configs
from megatrain_jax.planning import presets, roofline
from megatrain_jax.tools import measure, plan

GiB = 2**30
# Rates measured on the H200 for 7b at 16 x 1024 tokens, without the host memory's
# bandwidth: a benchmark JSON as `plan --rates` reads it.
RATES_7B = {"h2d_gbps": 53.28376885968488, "d2h_gbps": 53.33238465561888,
            "layer_forward_s": 0.010479104000012285, "layer_backward_s": 0.028915388000001485,
            "head_s": 0.05402032800000711, "optimizer_gparams": 6.045185168568684,
            "overlapped_update": True}


def test_check_fits_refuses_with_the_numbers():
    cfg = load_config("7b", ["data.batch_size=16", "data.seq_len=1024"])
    # 7b with bf16 layer gradients (stream.grad_dtype=auto) measured 96.1 GiB at peak.
    with pytest.raises(ConfigError, match=r"needs 96.3 GiB of host memory .* only 64.0 GiB"):
        plan.check_fits(cfg, host=64 * GiB, gpu=80 * GiB)
    on_gpu = dataclasses.replace(cfg, stream=dataclasses.replace(cfg.stream,
                                                                 saved_inputs="device"))
    with pytest.raises(ConfigError, match=r"about 18.1 GiB of GPU memory .* XLA may use 16.0 GiB"
                                          r".*Changes that fit: stream.saved_inputs=auto; "
                                          r"stream.saved_inputs=pinned_host"):
        plan.check_fits(on_gpu, host=125 * GiB, gpu=16 * GiB)
    plan.check_fits(cfg, host=125 * GiB, gpu=16 * GiB)  # auto: some inputs to the host
    plan.check_fits(cfg, host=125 * GiB, gpu=139 * GiB)  # the H200 machine: fits
    # Micro-batches shrink the step's workspace.
    split = load_config("7b", ["data.batch_size=16", "data.seq_len=1024",
                               "data.micro_batches=4"])
    assert plan.estimate(split)["device_total"] < plan.estimate(cfg)["device_total"]


@pytest.mark.parametrize("overrides, host_gib, gpu_gib", [
    (["data.batch_size=16", "data.seq_len=1024", "stream.saved_inputs=device"], 125, 16),
    (["data.batch_size=16", "data.seq_len=1024", "stream.saved_inputs=device"], 125, 17),
    (["data.batch_size=16", "data.seq_len=1024"], 125, 14),
    (["data.batch_size=1", "data.seq_len=524288"], 125, 140),
    (["data.batch_size=1", "data.seq_len=65536", "stream.saved_inputs=pinned_host",
      "stream.grad_dtype=float32"], 125, 140),
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
        est = plan.estimate(candidate, gpu)
        sizes[name] = (candidate.model.num_params,
                       est["host_total"] <= host and est["device_total"] <= gpu)
    fitting = [n for n, (_, fits) in sizes.items() if fits]
    assert found is not None and found[0] in fitting
    assert sizes[found[0]][0] == max(sizes[n][0] for n in fitting)
    assert found[1].data == cfg.data  # the user's settings, another shape
    if host_gib == 125:
        # 7b with bf16 layer gradients measured 96.1 GiB at peak, planned 96.3: llama3-8b
        # (8.0B) is the largest that fits the 125 GiB box.
        assert found[0] == "llama3-8b"
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
    assert main(["plan", "7b", "data.batch_size=16", "data.seq_len=1024",
                 "--rates", str(rates_file)]) == 0
    out = capsys.readouterr().out
    for part in ("master_weights", "optimizer_state", "gradients", "pinned host pool",
                 "saved_inputs", "workspace", "host memory: 125.00 GiB -> fits",
                 "GPU memory: 132.05 GiB of 139.00 GiB (XLA's share) -> fits",
                 "largest shipped shape that fits this machine: llama3-8b",
                 "layer gradients to the host in bfloat16 (stream.grad_dtype=auto)"):
        assert part in out, part
    rates = roofline.Rates.from_result(RATES_7B)
    # The embedding and the head live on the GPU there (stream.resident_embeddings=auto).
    cfg = memory.resolved(load_config("7b"), plan.usable_gpu_bytes(139 * GiB))
    assert cfg.stream.resident_embeddings == "on" and "embedding and head" in out
    share, step_s = roofline.best_speculate_share(cfg, rates)  # stream.speculate=auto
    assert f"step bound at these settings: {step_s:.3f} s" in out
    assert f"of which the update during the backward: {share:g} of it" in out and share > 0
    assert step_s < roofline.bound(cfg.model, rates,
                                   grad_bytes=roofline.gradient_bytes(cfg))["step_s"]
    # At these rates the layers' compute is the largest single cost, and the host memory's
    # bandwidth is not in the file.
    assert "the largest cost: compute" in out and "host memory unmeasured" in out
    # The head is serial, so the layers' forward must outlast the paced stream alone: about
    # 52k tokens at these rates, with the host holding the layers only (54k with all).
    kept = memory.unfetched_layers(cfg, plan.usable_gpu_bytes(139 * GiB))
    tokens = roofline.compute_bound_tokens(cfg.model, rates, 16384, resident_embeddings=True,
                                           kept_layers=kept)
    assert f"compute-bound from about {tokens:,} tokens" in out and 52_000 < tokens < 53_000


@pytest.fixture
def small_samples(monkeypatch):
    """The rate measurement on smaller samples than a real machine's (the same code)."""
    from megatrain_jax.tools import machine

    monkeypatch.setattr(plan, "OPTIMIZER_SAMPLE", 8 * 2**20)
    sized = machine.memory_gbps
    monkeypatch.setattr(machine, "memory_gbps",
                        lambda **kw: sized(**{"window_s": 0.1, **kw, "mfloats": 32}))


def test_the_shared_bandwidth_counts_the_transfer_beside_the_kernel():
    """memory_gbps(beside=(move, nbytes)) adds the bytes of every move that ended within the
    kernel's window: here about twenty 1 GB "moves" in 0.2 s, far above the kernel alone."""
    from megatrain_jax.tools import machine

    alone = machine.memory_gbps(mfloats=8)
    moves = []

    def move():
        time.sleep(0.01)
        moves.append(1)

    shared = machine.memory_gbps(mfloats=8, beside=(move, 10**9), window_s=0.2)
    assert moves and alone > 0
    assert shared > alone + 20


def test_plan_measure_on_this_machine(capsys, small_samples):
    assert main(["plan", "tiny", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "rates: H2D" in out and "compute-bound from about" in out
    assert re.search(r"the update loses \d+% of its rate beside a copy in, \d+% beside one out",
                     out)
    # Measured on two streamed layers whatever the run keeps on the GPU.
    assert main(["plan", "tiny", "model.layers=3", "stream.resident_layers=3", "--measure"]) == 0
    assert "step bound at these settings" in capsys.readouterr().out


def test_the_link_is_timed_from_pinned_host_memory_with_resident_layers():
    import jax

    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.train import StreamTrainer

    cfg = load_config("tiny", ["model.layers=3", "stream.resident_layers=2"])
    trainer = StreamTrainer(cfg)
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
    cfg = load_config("7b", ["stream.grad_dtype=float32", "stream.speculate=off"])
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
    cfg = load_config("7b", ["stream.speculate=on", "stream.grad_dtype=float32"])
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
    # Off, the schedule is the usual one; with the update on the device, guessing is too.
    off = load_config("7b", ["stream.grad_dtype=float32", "stream.speculate=off"])
    usual = roofline.bound_for(off, rates)
    assert usual["host_memory_forward_s"] == pytest.approx((28 + 4) * p / 100e9)
    serial = dataclasses.replace(rates, overlapped_update=False)
    assert roofline.bound_for(cfg, serial)["step_s"] == \
        roofline.bound_for(off, serial)["step_s"]


def test_a_guessing_step_takes_the_best_share_of_the_update_beside_the_backward():
    """A share f of the update beside the backward: f of its bytes and time there, the rest
    beside the forward. A step that guesses drops the guesses still queued when the
    backward ends, so its bound is that of the best share (up to stream.speculate_share):
    the one that fills the backward's spare host memory."""
    fp32_grads = ["stream.grad_dtype=float32"]
    cfg = load_config("7b", fp32_grads)  # stream.speculate=auto, the default
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
    off = load_config("7b", [*fp32_grads, "stream.speculate=off"])
    assert seconds < roofline.bound_for(off, rates)["step_s"]
    capped = load_config("7b", [*fp32_grads, "stream.speculate_share=0.1"])
    assert roofline.bound_for(capped, rates)["step_s"] == pytest.approx(
        roofline.bound(cfg.model, rates, grad_bytes=4, speculate=0.1)["step_s"])


def test_measured_host_memory_is_at_least_what_the_update_moved(small_samples):
    from megatrain_jax.tools.measure import measure_rates

    rates = measure_rates(load_config("tiny"))
    assert rates.overlapped_update
    assert rates.host_memory_gbps >= rates.optimizer_gparams * roofline.HOST_UPDATE_BYTES > 0
    assert 0 <= rates.update_loss_h2d < 1 and 0 <= rates.update_loss_d2h < 1


def test_bf16_layer_gradients_halve_their_host_bytes_and_traffic():
    fp32 = load_config("7b", ["stream.grad_dtype=float32"])
    half = load_config("7b", ["stream.grad_dtype=bfloat16"])  # layer gradients in bf16
    # auto: bf16 where they are bf16 values (bf16 compute, one micro-batch, one device).
    assert plan.estimate(load_config("7b"))["host"] == plan.estimate(half)["host"]
    for fp32_values in (["data.micro_batches=2"], ["model.compute_dtype=float32"]):
        assert roofline.gradient_bytes(load_config("7b", fp32_values)) == 4
    assert roofline.gradient_bytes(load_config("7b"), devices=2) == 4
    # Unsaid, the devices are the run's: a mesh's gradients are fp32 sums, read by the update.
    assert roofline.gradient_bytes(load_config("7b", ["mesh.data=2"])) == 4
    assert roofline.update_bytes(load_config("7b", ["mesh.data=2"])) == 28
    layer_params = half.model.layers * half.model.params_per_layer
    saved = plan.estimate(fp32)["host"]["gradients"] - plan.estimate(half)["host"]["gradients"]
    assert saved == pytest.approx(2 * layer_params, abs=1)
    assert roofline.gradient_bytes(fp32) == 4
    assert roofline.gradient_bytes(load_config("7b", ["data.micro_batches=2",
                                                      "stream.grad_dtype=bfloat16"])) == 4
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
    before, after = plan.estimate(base), plan.estimate(cfg)
    # Weights, two moments and gradients, and the pool's bookkeeping for them (the pool is
    # sized in whole GiB: its margin takes up the rounding).
    assert before["host_total"] - after["host_total"] == pytest.approx(
        16 * moved * (1 + plan.POOL_BOOKKEEPING), abs=1.1 * GiB)
    assert after["device"]["resident_layers"] == 16 * moved  # and the step's gradients
    assert after["device_total"] - before["device_total"] == 16 * moved
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
    # The GPU's share is refused with the option named when it does not fit; compact
    # moments shrink the resident layers' state.
    everything = load_config("7b", ["stream.resident_layers=32"])
    with pytest.raises(ConfigError, match="Changes that fit: optim.state_dtype=int8"):
        plan.check_fits(everything, host=125 * GiB, gpu=80 * GiB)
    with pytest.raises(ConfigError, match="fewer stream.resident_layers"):
        plan.check_fits(everything, host=125 * GiB, gpu=40 * GiB)


@pytest.mark.parametrize("resident", [0, 16, 32])
def test_the_pinned_pool_holds_the_state_and_the_rate_measurement(resident):
    """bench_step and plan --measure pin copies of layers and an optimizer sample beside the
    host state, whatever stream.resident_layers leaves on the host."""
    cfg = load_config("7b", [f"stream.resident_layers={resident}"])
    host = plan.estimate(cfg)["host"]
    state = sum(host[name] for name in plan.PINNED)
    sampled = 4 * plan.MEASURED_LAYERS * cfg.model.params_per_layer + 16 * plan.OPTIMIZER_SAMPLE
    assert plan.measurement_bytes(cfg) == sampled
    assert plan.pinned_pool_bytes(cfg, measuring=True) >= state + sampled
    # A run that does not measure asks for the state and a margin only: the pool is resident.
    assert plan.pinned_pool_bytes(cfg) == state + plan.POOL_MARGIN


def test_a_refusal_names_the_compact_state_that_fits(capsys):
    """14b's fp32 state does not fit the 125 GiB box; int8 moments with bf16 layer gradients
    (the default where exact) do (measured there: 105.6 GiB), and the refusal names them;
    with fp32 gradients asked for, int8 alone names bf16 gradients."""
    box = ["--host-gb", "125", "--gpu-gb", "140"]
    assert main(["plan", "14b", *box]) == 1
    assert "Changes that fit: optim.state_dtype=int8." in capsys.readouterr().err
    assert main(["plan", "14b", "optim.state_dtype=int8", "stream.grad_dtype=float32",
                 *box]) == 1
    assert "Changes that fit: stream.grad_dtype=bfloat16." in capsys.readouterr().err
    assert main(["plan", "14b", "optim.state_dtype=int8", *box]) == 0
    out = capsys.readouterr().out
    modes = plan.host_bytes_per_param(load_config("14b", ["stream.grad_dtype=bfloat16"]),
                                      133 * GiB)
    assert list(modes) == ["float32", "bfloat16", "int8"]
    # Two fp32 moments -> bf16, and the pool's bookkeeping for them (whole GiB: +-0.1 B/param)
    assert modes["float32"] - modes["bfloat16"] == pytest.approx(4 * (1 + 1 / 32), abs=0.1)
    assert 8.5 < modes["int8"] < 9.0  # 4 + 2 + 2.03, the pool's margin and bookkeeping, runtime
    assert "float32 14.9, bfloat16 10.8, int8 8.7" in out
    # Without compact moments (Lion), no such change exists.
    with pytest.raises(ConfigError) as refused:
        plan.check_fits(load_config("14b", ["optim.name=lion"]), host=100 * GiB, gpu=133 * GiB)
    assert "state_dtype" not in str(refused.value)


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
    gpu = plan.usable_gpu_bytes(140 * GiB)  # auto settled as the plan settles it
    step_s = roofline.bound_for(memory.resolved(load_config("120b"), gpu), rates)["step_s"]
    assert f"step bound at these settings: {step_s:.3f} s" in out
    assert f"expected step: {step_s * 1.25:.3f} s ({16384 / (step_s * 1.25):,.0f} tokens/s)" \
        in out and "(4 layers, 16,384 tokens per step, 2.000 s)" in out
    assert main(["plan", "120b", "data.batch_size=64", "--host-gb", "2000", "--gpu-gb", "140",
                 "--rates", str(rates_file)]) == 0
    wide = roofline.bound_for(memory.resolved(load_config("120b", ["data.batch_size=64"]), gpu),
                              presets.scaled(rates, 4))["step_s"]
    assert f"expected step: {wide * 1.25:.3f} s" in capsys.readouterr().out
    assert main(["plan", "7b", "--rates", str(rates_file)]) == 2
    assert "measured on a model of another width" in capsys.readouterr().err


def test_the_gpus_counted_are_those_cuda_visible_devices_leaves(monkeypatch):
    """A run on some of a machine's GPUs is planned for those (one GPU: bf16 gradients and
    its pool), not for every GPU nvidia-smi lists."""
    from megatrain_jax.tools import probe

    for visible, count in (("0", 1), ("0,1,2,3", 4), ("2,3", 2), ("", 1)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        probe.gpu_count.cache_clear()
        assert probe.gpu_count() == count
        assert probe.planned_devices(load_config("7b")) == count  # mesh.data=0: all of them
    probe.gpu_count.cache_clear()


def test_each_gpu_of_a_mesh_gets_a_pool_for_its_share_of_the_state():
    """XLA gives each GPU a pinned pool of its own under one cap: a mesh over which the width
    splits caps each at a 1/n share and the margin; one that does not, at the whole."""
    one = load_config("7b", ["mesh.data=1"])
    four = load_config("7b", ["mesh.data=4", "data.batch_size=64"])
    pinned = plan.pinned_bytes(four)
    assert plan.pool_limit_gib(four, pinned) == (pinned // 4 + plan.POOL_MARGIN) // GiB + 1
    assert plan.pool_limit_gib(four, pinned) < plan.pool_limit_gib(one, plan.pinned_bytes(one)) / 3
    assert plan.pinned_pool_bytes(four) == 4 * (pinned // 4 + plan.POOL_MARGIN)
    host = plan.estimate(four)["host"]
    assert host["pool_margin"] == 4 * plan.pool_limit_gib(four, pinned) * GiB - pinned
    three = load_config("7b", ["mesh.data=3", "data.batch_size=48"])  # 4096 % 3: kept whole
    assert plan.pool_limit_gib(three, pinned) == (pinned + plan.POOL_MARGIN) // GiB + 1


def test_the_host_memory_traffic_of_a_step_grows_over_a_mesh_by_the_fp32_gradients_only():
    """Each GPU of a mesh reads its shard of the weights, so they cross the host's memory once
    as on one GPU; the gradients, sums over the GPUs, are fp32 (written, then read by the
    update) where one GPU's are bf16."""
    one = plan.host_traffic(load_config("7b", ["mesh.data=1"]))
    four_cfg = load_config("7b", ["mesh.data=4", "data.batch_size=64"])
    four = plan.host_traffic(four_cfg)
    assert one["weights"] == four["weights"] == 8
    assert four["gradients"] == 4 and 2 < one["gradients"] < 2.2  # the edges' stay fp32
    assert four["update"] - one["update"] == pytest.approx(four["gradients"] - one["gradients"])
    assert four["update"] == 28  # p, g, mu, nu read; p, mu, nu written
    assert "40.0 bytes a host-held parameter" in plan.traffic_lines(four_cfg)[0]
    assert plan.traffic_lines(load_config("7b", ["stream.update=device"])) == []


def test_the_bound_over_a_mesh_counts_fp32_gradients():
    """The same rates, one GPU against a mesh: the mesh's gradients are sums (fp32), so its
    gradient traffic and its update's bytes are the larger."""
    rates = roofline.Rates(**{**RATES_7B, "host_memory_gbps": 150.0})
    one = roofline.bound_for(load_config("7b", ["mesh.data=1"]), rates)
    two = roofline.bound_for(load_config("7b", ["mesh.data=2", "data.batch_size=32"]), rates)
    assert two["d2h_s"] == pytest.approx(one["d2h_s"] * 4 / roofline.gradient_bytes(
        load_config("7b", ["mesh.data=1"])))
    host = lambda b: b["host_memory_forward_s"] + b["host_memory_backward_s"]  # noqa: E731
    assert host(two) == pytest.approx(host(one) * 40.0 / (8 + 2 * roofline.gradient_bytes(
        load_config("7b", ["mesh.data=1"])) + 24))


def test_a_mesh_that_does_not_divide_the_width_holds_the_state_on_every_gpu():
    """mesh.data=3 with a width of 4096: no weight matrix splits, so each GPU's pool holds the
    whole state, and the plan says so rather than hiding it in the margin."""
    three = load_config("7b", ["mesh.data=3", "data.batch_size=48"])
    host = plan.estimate(three)["host"]
    pinned = sum(host[name] for name in plan.PINNED)
    assert host["replicas"] == 2 * pinned
    assert 0 <= host["pool_margin"] <= 3 * (plan.POOL_MARGIN + GiB)
    assert "replicas" not in plan.estimate(load_config("7b", ["mesh.data=4",
                                                           "data.batch_size=64"]))["host"]
