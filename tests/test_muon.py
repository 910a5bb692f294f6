"""Muon (optim.name=muon: optax.contrib.muon) streamed, against optax.contrib.muon applied by
plain jax.grad to the whole model (the reference trainer), fp32 on the CPU.

Newton–Schulz raises a matrix's small singular directions by up to about 3.4445 a step (its
slope at zero), so the rounding in which the two trainers' gradients differ (the reference
sums them in another order) reaches the weights larger than under AdamW: at optim.lr=0.005
the 20 steps end within 7e-6 of the reference's on one device and on four. The update itself
adds nothing: given the same gradients the engine's update is the reference's, bit for bit.
"""

import json
import os
import subprocess
import sys
from functools import partial
from itertools import islice
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FAST_COMPILE, max_rel_error, normal, side_by_side, stream_run, tiny
from flax import nnx
from nnx_list_model import ListModel, summed_loss

from megatrain_jax import model, optim, streaming
from megatrain_jax.config import ConfigError
from megatrain_jax.io.data import TokenSource
from megatrain_jax.planning.optimizer_state import muon_bytes
from megatrain_jax.stream.placement import parts
from megatrain_jax.train import train

# Newton–Schulz in fp32, the arithmetic of optax.contrib.muon, which the reference runs.
MUON = ["optim.name=muon", "optim.muon.ns_dtype=float32", "optim.lr=0.005",
        "optim.clip_norm=2.0", "model.layers=2", "schedule.warmup_steps=3", "loop.steps=20"]
STEPS = 20
RUNS = Path(__file__).resolve().parent / "muon_runs.py"


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _bits_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """The 4-device run, started first: it runs in its own process beside this one's."""
    out = tmp_path_factory.mktemp("muon_mesh") / "out.json"
    env = {**os.environ, "PYTHONPATH": f"{RUNS.parent.parent}{os.pathsep}"
           f"{os.environ.get('PYTHONPATH', '')}", "XLA_FLAGS": FAST_COMPILE}
    process = subprocess.Popen([sys.executable, str(RUNS), "4", str(out)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield lambda: (process.communicate(timeout=600), out)


@pytest.fixture(scope="module")
def run(mesh_run):
    """Twenty steps, the first layer resident on the device and the others streamed, beside
    the reference; then one more step whose gradients are known to both."""
    cfg = tiny(*MUON, "stream.resident_layers=1")
    ref_state, state, stream, records = side_by_side(cfg, STEPS)
    return {"cfg": cfg, "ref": ref_state, "state": state, "stream": stream,
            "records": records, "mesh": mesh_run}


def test_twenty_clipped_steps_match_the_whole_model_reference(run):
    records, cfg = run["records"], run["cfg"]
    norms = [r["grad_norm"] for r in records]
    assert any(n > cfg.optim.clip_norm for n in norms), norms  # clipping acts on some steps
    assert any(n < cfg.optim.clip_norm for n in norms), norms  # and not on others
    np.testing.assert_allclose([r["loss"] for r in records], [r["ref_loss"] for r in records],
                               rtol=1e-5)
    assert max_rel_error(run["state"].params, run["ref"].params) <= 1e-5
    assert run["stream"].engine.placement.is_resident(1)  # layer 0 on the device
    assert not run["stream"].engine.placement.is_resident(2)  # layer 1 streamed
    start = model.init(cfg.model, jax.random.key(0))  # side_by_side's start
    assert max_rel_error(run["state"].params, start) > 0.1  # moved far beyond the tolerance


def test_muon_orthogonalizes_the_layer_matrices_and_keeps_adamw_for_the_rest(run):
    """The state the engine keeps is Muon's: one momentum for each layer matrix, AdamW's two
    moments for the embedding, head, norms and biases, as planning/optimizer_state.py counts."""
    state, cfg = run["state"], run["cfg"]
    for part, params, kind in ((state.opt_state["layers"][1], state.params["layers"][1],
                                "layers"),
                               (state.opt_state["embed"], state.params["embed"], "edges")):
        count = sum(leaf.size for leaf in jax.tree.leaves(params))
        held = sum(leaf.nbytes for leaf in jax.tree.leaves(part) if leaf.ndim)
        coefficients = 3 * 4  # Newton–Schulz's, kept in the state of every part
        assert held - coefficients == pytest.approx(muon_bytes(cfg, kind) * count, abs=1)
    dims = optim.muon_dimensions(state.params)
    assert dims["embed"].table is None and dims["head"].out is None
    assert dims["layers"][0].wq is not None and dims["layers"][0].attn_norm is None


def test_the_update_is_the_references_bit_for_bit_given_the_same_gradients(run):
    """The engine's update of each part (on the device for the resident layer, streamed for
    the others) is optax's of that part, bit for bit; and optax's of the whole model is its
    update of each part, bit for bit: each matrix is its own Newton–Schulz problem."""
    stream, state, cfg = run["stream"], run["state"], run["cfg"]
    batch = TokenSource(cfg).batch_at(STEPS)
    before = _host({"params": state.params, "opt_state": state.opt_state})
    _, grads, _, skip, scale = stream.engine.forward_backward(state.params, batch)
    grads, scale, skip = _host(grads), np.asarray(scale), np.asarray(skip)
    state, _ = stream.train_step(state, batch)
    opt = optim.build_optimizer(cfg)
    step = jax.jit(partial(optim.apply_update, opt))
    update = lambda p, g, s: step(p, g, s, scale, skip)  # noqa: E731
    for k, (p, g, s) in enumerate(zip(*(parts(before[name]) if name else parts(grads)
                                        for name in ("params", None, "opt_state")))):
        expected = update(p, g, s)
        assert _bits_equal(parts(state.params)[k], expected[0]), k
        assert _bits_equal(parts(state.opt_state)[k], expected[1]), k
    whole_params = before["params"]
    whole = update(whole_params, grads, opt.init(whole_params))[0]
    by_part = [update(p, g, opt.init(p))[0] for p, g in zip(parts(whole_params), parts(grads))]
    assert _bits_equal(parts(whole), by_part)
    run["state"] = state


def test_a_nan_gradient_skips_the_step_and_writes_nothing(run):
    stream, state = run["stream"], run["state"]
    batch = TokenSource(run["cfg"]).batch_at(STEPS + 1)
    batch["mask"][0, 0] = float("nan")  # the loss, so every gradient, is NaN
    before = _host({"params": state.params, "opt_state": state.opt_state})
    state, metrics = stream.train_step(state, batch)
    assert bool(metrics["skipped"])
    after = _host({"params": state.params, "opt_state": state.opt_state})
    assert _bits_equal(after, before)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(after)
               if np.issubdtype(leaf.dtype, np.floating))
    run["state"] = state


# Newton–Schulz in bfloat16 (optim.muon.ns_dtype's default), streamed, against the fp32
# reference over the same 20 steps: measured losses within 3.1e-4 (relative) and the layers'
# weights within 4.8e-2 (max_rel_error: the largest difference of a leaf over its largest
# value; they moved 0.55 from the start), held to 1e-3 and 0.1 (docs/guide.md, "Muon").
BF16_LOSS_RTOL, BF16_WEIGHTS_REL = 1e-3, 0.1


def test_bfloat16_newton_schulz_stays_near_the_float32_reference(run):
    """The layers' weights: the embedding takes AdamW, under which a row one step's tokens
    touch moves by about lr times the sign of its gradient, whatever the gradient's size."""
    cfg = tiny(*MUON, "stream.resident_layers=1", "optim.muon.ns_dtype=bfloat16")
    state, losses, _, _ = stream_run(cfg, STEPS)
    np.testing.assert_allclose(losses, [r["ref_loss"] for r in run["records"]],
                               rtol=BF16_LOSS_RTOL)
    rel = max_rel_error(state.params["layers"], run["ref"].params["layers"])
    assert 1e-3 < rel <= BF16_WEIGHTS_REL, rel  # bf16 indeed, and near
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.opt_state)
               if jnp.issubdtype(leaf.dtype, jnp.floating))  # the momentum stays fp32


def _noise(seed, leaf):
    return jnp.asarray(normal(seed, leaf.shape, 0.1))


def test_float32_newton_schulz_is_optax_muon_bit_for_bit():
    """optim/muon.py with ns_dtype=float32 against optax.contrib.muon given cfg's settings:
    the same state and updates, bit for bit, over two steps of the defaults and of every
    other setting."""
    params = model.init(tiny("model.layers=1").model, jax.random.key(0))
    for extra in ([], ["optim.muon.ns_coeffs=dion", "optim.muon.nesterov=false",
                       "optim.state_dtype=bfloat16", "optim.muon.consistent_rms=0.2",
                       "optim.muon.adam_weight_decay=0.01"]):
        cfg = tiny("optim.name=muon", "model.layers=1", "optim.muon.ns_dtype=float32", *extra)
        o, m, lr = cfg.optim, cfg.optim.muon, optim.learning_rate(cfg)
        reference = optax.contrib.muon(
            lr, ns_coeffs=m.ns_coeffs, ns_steps=m.ns_steps, beta=m.beta, eps=o.eps,
            weight_decay=o.weight_decay, nesterov=m.nesterov,
            mu_dtype=jnp.bfloat16 if o.state_dtype == "bfloat16" else None, adam_b1=o.b1,
            adam_b2=o.b2, adam_weight_decay=m.adam_weight_decay,
            muon_weight_dimension_numbers=optim.muon_dimensions,
            consistent_rms=m.consistent_rms or None)
        ours = optim.build_optimizer(cfg)
        runs = []
        for opt in (reference, ours):
            p, state, update = params, opt.init(params), jax.jit(opt.update)
            for k in range(2):
                grads = jax.tree.map(partial(_noise, k), params)
                updates, state = update(grads, state, p)
                p = optax.apply_updates(p, updates)
            runs.append((p, state))
        assert jax.tree.structure(runs[0]) == jax.tree.structure(runs[1]), extra
        assert _bits_equal(*runs), extra


def test_four_devices_match_the_one_device_reference(run):
    """`run`'s twenty steps on four devices (tests/muon_runs.py), against its reference."""
    (output, _), out = run["mesh"]()
    assert out.exists(), output[-4000:]
    result = json.loads(out.read_text())
    assert result["devices"] == 4 and result["mesh"] == 4  # the state over all four
    assert result["split"] > 0  # the state split over the devices
    norms = result["norms"]
    assert any(n > 2.0 for n in norms) and any(n < 2.0 for n in norms)
    np.testing.assert_allclose(result["losses"], [r["ref_loss"] for r in run["records"]],
                               rtol=1e-5)
    with np.load(f"{out}.npz") as trained:
        params = jax.tree.unflatten(jax.tree.structure(run["ref"].params),
                                    [trained[f"arr_{i}"] for i in range(len(trained.files))])
    assert max_rel_error(params, run["ref"].params) <= 1e-5


def _loop_cfg(run_dir, *more):
    """`run`'s config in the training loop, its schedule fixed at `run`'s 20 steps (the
    update programs, which hold the schedule, are `run`'s)."""
    return tiny(*MUON, "stream.resident_layers=1", "loop.log_every=1",
                "loop.progress=none", "loop.tensorboard=off", "loop.timeline_step=-1",
                f"schedule.decay_steps={STEPS}", f"loop.run_dir={run_dir}", *more)


def test_resume_continues_bit_for_bit(tmp_path):
    straight = train(_loop_cfg(tmp_path / "a", "loop.steps=6"))
    train(_loop_cfg(tmp_path / "b", "loop.steps=3", "loop.checkpoint_every=3"))
    resumed = train(_loop_cfg(tmp_path / "b", "loop.steps=6", "loop.checkpoint_every=3"))
    assert resumed["state"].step == 6
    assert _bits_equal(straight["state"].params, resumed["state"].params)
    assert _bits_equal(straight["state"].opt_state, resumed["state"].opt_state)


@pytest.mark.parametrize("overrides, message", [
    (["optim.state_dtype=int8"], r"optim.state_dtype=int8 is a form of Adam's moments; Muon "
                                 r"stores its momentum in float32 or bfloat16"),
    (["stream.update=host"], r"stream.update=host has kernels for optim.name adamw and adam, "
                             r"not 'muon'; use stream.update=device"),
    (["stream.speculate=on"], r"Muon updates on the GPU after the backward.*stream.speculate="
                              r"auto or off"),
    (["optim.muon.ns_coeffs=dion", "optim.muon.ns_steps=3"],
     r"optim.muon.ns_coeffs=dion is 5 steps.*optim.muon.ns_steps=5 \(got 3\)"),
    (["optim.muon.beta=1.0"], r"optim.muon.beta \(1.0\) must be within \[0, 1\)"),
])
def test_settings_muon_cannot_run_are_refused_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny("optim.name=muon", *overrides)


# ----- Flax: optax.contrib.muon passed to the streaming step ---------------------------

VOCAB, DIM, SEQ, CLIP = 64, 16, 8, 0.63


def _batches(seed=0, rows=4):
    rng = np.random.default_rng(seed)
    while True:
        tokens = rng.integers(0, VOCAB, (rows, SEQ + 1))
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
               "mask": np.ones((rows, SEQ), np.float32)}


def test_a_flax_model_with_optax_muon_trains_like_jax_grad():
    """optax.contrib.muon as a Flax user writes it (every 2-D leaf orthogonalized, the rest
    AdamW) through from_nnx_model, against jax.grad with the clip in the chain."""
    model, batches = ListModel(nnx.Rngs(0)), list(islice(_batches(), STEPS))
    muon = optax.contrib.muon(0.01)
    graphdef, params = nnx.split(model, nnx.Param)
    step = streaming.from_nnx_model(model, summed_loss, muon, embed="wte", clip_norm=CLIP)
    state, history = step.init_state(), []
    for batch in batches:
        state, metrics = step.train_step(state, batch)
        history.append([float(metrics["loss"]), float(metrics["grad_norm"])])

    def loss_of(p, batch):
        logits = nnx.merge(graphdef, p)(batch["inputs"])
        return summed_loss(logits, batch) / jnp.sum(batch["mask"])

    chain = optax.chain(optax.clip_by_global_norm(CLIP), muon)

    @jax.jit
    def reference(p, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_of)(p, batch)
        updates, opt_state = chain.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss, optax.global_norm(grads)

    p, opt_state, expected = nnx.to_pure_dict(params), None, []
    opt_state = chain.init(p)
    for batch in batches:
        p, opt_state, loss, norm = reference(p, opt_state, batch)
        expected.append([float(loss), float(norm)])
    norms = [n for _, n in expected]
    assert any(n > CLIP for n in norms) and any(n < CLIP for n in norms), norms
    np.testing.assert_allclose(history, expected, rtol=1e-5)
    assert max_rel_error(step.user_params(state), p) <= 1e-5


# ----- what plan counts -----------------------------------------------------------------


def test_plan_counts_half_adamws_host_state_at_7b():
    from megatrain_jax.config import load_config
    from megatrain_jax.planning import memory

    def state_per_param(*overrides):
        cfg = load_config("7b", list(overrides))
        host = memory.host_state_bytes(cfg, memory.PlacementPlan())  # everything streamed
        return (host["master_weights"] + host["optimizer_state"] + host["gradients"]) \
            / cfg.model.num_params

    assert state_per_param("optim.name=muon") <= 10.5
    assert state_per_param("optim.name=muon", "optim.state_dtype=bfloat16") <= 8.5
    assert state_per_param() >= 14.0  # AdamW's


def test_newton_schulz_flops_are_the_compiled_iterations():
    """device_update's count of a layer's Newton–Schulz FLOPs against XLA's own count of
    optax's Muon update of the same matrices (its elementwise work: about 1% more at these
    sizes, less at a real model's)."""
    from megatrain_jax.planning import device_update

    cfg = tiny("optim.name=muon", "model.layers=1", "model.hidden=256", "model.ffn=512")
    muon = optax.contrib.scale_by_muon(ns_steps=cfg.optim.muon.ns_steps)
    counted = 0.0
    for rows, cols in device_update.layer_matrices(cfg):
        x = jnp.ones((rows, cols))
        update = jax.jit(lambda g: muon.update(g, muon.init(g))[0])
        cost = update.lower(x).compile().cost_analysis()
        counted += (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert device_update.newton_schulz_flops(cfg) == pytest.approx(counted, rel=0.03)


def test_the_bound_counts_newton_schulz_for_every_layer_resident_or_streamed():
    """At 7b (16 x 1024 tokens) on the H200's preset, Muon's Newton–Schulz is in the bound
    whether the layers live on the GPU or stream: about 2 s a step in fp32, added to a step
    that has no link traffic where everything is resident."""
    import dataclasses

    from megatrain_jax.config import load_config
    from megatrain_jax.planning import device_update, presets, roofline
    from megatrain_jax.planning.memory import PlacementPlan

    cfg = load_config("7b", ["optim.name=muon", "optim.muon.ns_dtype=float32",
                             "data.batch_size=16", "data.seq_len=1024"])
    rates = presets.PRESETS["H200"].rates(cfg)
    ns_s = device_update.newton_schulz_flops(cfg) / (651e12 * device_update.FP32_MATMUL_SHARE)
    assert rates.newton_schulz_s == pytest.approx(ns_s) and 1.5 < ns_s < 3.0
    bf16 = load_config("7b", ["optim.name=muon", "data.batch_size=16", "data.seq_len=1024"])
    assert presets.PRESETS["H200"].rates(bf16).newton_schulz_s == pytest.approx(ns_s / 2)
    resident = PlacementPlan(resident_layers=cfg.model.layers, resident_embeddings=True)
    without = dataclasses.replace(rates, newton_schulz_s=0.0)
    for placement in (resident, PlacementPlan()):
        b = roofline.bound_of(cfg, placement, rates, 1)
        assert b["newton_schulz_s"] == pytest.approx(ns_s)
        assert b["step_s"] - roofline.bound_of(cfg, placement, without, 1)["step_s"] == \
            pytest.approx(ns_s)
    b = roofline.bound_of(cfg, resident, rates, 1)
    assert b["optimizer_s"] == 0 and b["h2d_per_pass_s"] == 0  # nothing streamed
    assert b["step_s"] > b["compute_forward_s"] + b["compute_backward_s"] + ns_s
    adamw = load_config("7b", ["data.batch_size=16", "data.seq_len=1024"])
    assert presets.PRESETS["H200"].rates(adamw).newton_schulz_s == 0


def test_adam_lr_is_the_adamw_rate_and_leaves_the_matrices_alone():
    """optim.muon.adam_lr scales the AdamW's updates (embedding, head, norms) on optim.lr's
    schedule; the matrices' updates are Muon's at optim.lr either way."""
    base = ["optim.name=muon", "optim.lr=0.02", "schedule.warmup_steps=2", "model.layers=1",
            "optim.muon.ns_steps=1"]
    shapes = model.abstract(tiny(*base).model)
    params = jax.tree.map(lambda s: normal(1, s.shape, 0.02), shapes)
    grads = jax.tree.map(lambda s: normal(2, s.shape), shapes)

    def second_update(cfg):  # step 1 of the warmup: half the peak rate
        opt = optim.build_optimizer(cfg)

        def two_steps(params, grads):
            _, state = opt.update(grads, opt.init(params), params)
            return opt.update(grads, state, params)[0]

        return jax.jit(two_steps)(params, grads)

    follows, own = second_update(tiny(*base)), second_update(tiny(*base, "optim.muon.adam_lr=2e-3"))
    np.testing.assert_array_equal(own["layers"][0].wq, follows["layers"][0].wq)
    for leaf in (lambda u: u["embed"].table, lambda u: u["layers"][0].mlp_norm):
        np.testing.assert_allclose(leaf(own), 0.1 * leaf(follows), rtol=1e-5)
    assert np.abs(leaf(follows)).max() > 1e-3
