"""The public streaming API against the same models built and trained the ordinary Flax way."""

import importlib.util
import re
import runpy
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Transfers, max_rel_error
from flax import nnx

from megatrain_jax import streaming
from megatrain_jax.stream.placement import memory_kinds

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Linen modules are dataclasses: their module must be known
    spec.loader.exec_module(module)
    return module


nnx_example = _load("nnx_streaming")
linen_example = _load("linen_streaming")


def _nnx_batch():
    return next(nnx_example.batches(batch_size=4))


class WholeModel(nnx.Module):
    """The NNX example's pieces as one ordinary NNX model."""

    def __init__(self, embed, blocks, head):
        self.embed, self.head = embed, head
        self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _nnx_ordinary_loss(model, batch):
    return nnx_example.summed_loss(model(batch["inputs"]), batch) / jnp.sum(batch["mask"])


def _as_parts(pure: dict) -> dict:
    blocks = pure["blocks"]
    return {"embed": pure["embed"], "head": pure["head"],
            "layers": [blocks[i] for i in sorted(blocks, key=int)]}


@pytest.mark.parametrize("options", [{}, {"keep_layers": 1, "keep_weights": 1}])
def test_nnx_gradients_equal_flax_grad(options):
    """Every layer streamed; or the last saving its activations and the one before keeping
    its fetched weights: each of those two fetched once."""
    batch = _nnx_batch()
    step = streaming.from_nnx(*nnx_example.build(), nnx_example.summed_loss, optax.sgd(0.1),
                              micro_batches=2, **options)
    state = step.init_state()
    transfers = Transfers()
    loss, grads, *_ = step.engine.forward_backward(state.params, batch, tracer=transfers)
    layers = len(state.params["layers"])
    once = {f"layer {i}" for i in range(layers - sum(options.values()), layers)}
    assert all(transfers.h2d.count(name) == (1 if name in once else 2)
               for name in (f"layer {i}" for i in range(layers)))
    model = WholeModel(*nnx_example.build())
    ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(_nnx_ordinary_loss))(model, batch)
    ref = _as_parts(nnx.to_pure_dict(ref_grads))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert max_rel_error(grads, ref) <= 1e-5
    assert memory_kinds(state.params) == {"pinned_host"}


def test_nnx_ten_steps_agree_with_ordinary_training():
    """A layer and the embedding and head on the device, the other layers streamed (every part
    streamed: the Flax models of test_flax_users.py, clipped, against jax.grad)."""
    opt = optax.adamw(3e-3)
    step = streaming.from_nnx(*nnx_example.build(), nnx_example.summed_loss, opt,
                              resident_layers=1, resident_embeddings=True)
    state = step.init_state()
    assert memory_kinds(state.params["layers"][0]) == {"device"}
    assert memory_kinds(state.params["layers"][1]) == {"pinned_host"}
    assert memory_kinds((state.params["embed"], state.params["head"])) == {"device"}
    model = WholeModel(*nnx_example.build())
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = opt.init(params)

    @jax.jit
    def ordinary_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: _nnx_ordinary_loss(nnx.merge(graphdef, p), batch))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    data = nnx_example.batches(batch_size=4)
    for _ in range(10):
        batch = next(data)
        state, metrics = step.train_step(state, batch)
        params, opt_state, ref_loss = ordinary_step(params, opt_state, batch)
        np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
    assert max_rel_error(state.params, _as_parts(nnx.to_pure_dict(params))) <= 1e-5


def _linen_ordinary(built, batch):
    embed, embed_params, layer, layer_params, head, head_params = built
    params = {"embed": embed_params["params"], "layers": [p["params"] for p in layer_params],
              "head": head_params["params"]}

    def loss(p):
        x = embed.apply({"params": p["embed"]}, batch["inputs"])
        for lp in p["layers"]:
            x = layer.apply({"params": lp}, x)
        pred = head.apply({"params": p["head"]}, x)
        return linen_example.summed_loss(pred, batch) / batch["y"].shape[0]

    return params, loss


def test_linen_gradients_and_ten_steps_agree():
    batch = linen_example.make_data()
    opt = optax.adam(1e-2)
    built = linen_example.build()
    step = streaming.from_linen(*built, linen_example.summed_loss, opt, micro_batches=4,
                                mask_key=None)
    state = step.init_state()
    params, loss_fn = _linen_ordinary(built, batch)
    loss, grads, *_ = step.engine.forward_backward(state.params, batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert max_rel_error(grads, ref_grads) <= 1e-5

    @jax.jit
    def ordinary_step(params, opt_state):
        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    opt_state = opt.init(params)
    for _ in range(10):
        state, metrics = step.train_step(state, batch)
        ref_loss, params, opt_state = ordinary_step(params, opt_state)
        np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
    assert max_rel_error(state.params, params) <= 1e-5


def test_layers_of_different_shape_are_refused():
    layers = [{"w": jnp.ones((4, 4))}, {"w": jnp.ones((4, 5))}]
    with pytest.raises(streaming.TemplateError, match=r"layer 1 parameter \['w'\]"):
        streaming.check_layers(layers)
    with pytest.raises(streaming.TemplateError, match="layer 1 differs in structure"):
        streaming.check_layers([{"w": jnp.ones(3)}, {"v": jnp.ones(3)}])
    rngs = nnx.Rngs(0)
    blocks = [nnx_example.Block(32, 4, rngs), nnx.Linear(32, 32, rngs=rngs)]
    with pytest.raises(streaming.TemplateError, match="not built like layer 0"):
        streaming.from_nnx(nnx.Embed(256, 32, rngs=rngs), blocks,
                           nnx_example.Head(32, 256, rngs), nnx_example.summed_loss,
                           optax.sgd(0.1))


def test_template_closing_over_arrays_is_refused():
    hidden_weight = jnp.ones((4, 4))  # closed over: would be a constant, never trained
    params = {"embed": {"w": jnp.ones((2, 4))}, "layers": [{"b": jnp.zeros(4)}] * 2,
              "head": {"w": jnp.ones((4, 1))}}
    batch = {"inputs": jnp.ones((3, 2)), "y": jnp.ones((3, 1))}
    with pytest.raises(streaming.TemplateError, match=r"closes over arrays \(float32\[4, 4\]\)"):
        streaming.from_functions(
            embed=lambda p, b: b["inputs"] @ p["w"],
            layer=lambda p, x: x @ hidden_weight + p["b"],
            head_loss=lambda p, x, b: jnp.sum((x @ p["w"] - b["y"]) ** 2),
            params=params, optimizer=optax.sgd(0.1), example_batch=batch, mask_key=None,
        )


def test_head_closing_over_arrays_is_refused():
    hidden_out = jnp.ones((4, 1))  # the output matrix closed over instead of passed in
    params = {"embed": {"w": jnp.ones((2, 4))}, "layers": [{"b": jnp.zeros(4)}] * 2,
              "head": {"bias": jnp.zeros(1)}}
    batch = {"inputs": jnp.ones((3, 2)), "y": jnp.ones((3, 1))}
    with pytest.raises(streaming.TemplateError, match=r"head loss closes over arrays"):
        streaming.from_functions(
            embed=lambda p, b: b["inputs"] @ p["w"],
            layer=lambda p, x: x + p["b"],
            head_loss=lambda p, x, b: jnp.sum((x @ hidden_out + p["bias"] - b["y"]) ** 2),
            params=params, optimizer=optax.sgd(0.1), example_batch=batch, mask_key=None,
        )


@pytest.mark.parametrize("name", ["nnx_streaming", "linen_streaming", "custom_loop"])
def test_examples_run_and_learn(name, monkeypatch, capsys):
    """Each example run as its script, `python examples/NAME.py --steps 20`: here, in this
    process (with the session's compiled programs), as its `__main__`."""
    path = EXAMPLES / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path), "--steps", "20"])
    runpy.run_path(str(path), run_name="__main__")
    stdout = capsys.readouterr().out
    assert "step  20" in stdout
    # Each printed line is "step N  <name> <loss> ...": the first loss against the last.
    losses = [float(m.group(1)) for m in
              re.finditer(r"^step +\d+ +\w+ +([-\d.]+)", stdout, re.M)]
    assert len(losses) >= 2 and losses[-1] < 0.8 * losses[0], stdout
