"""Whole Flax models as their users write them (blocks stacked by nnx.vmap/nnx.scan or
nn.scan), trained by the streaming step against plain jax.grad + optax, and given back."""

import importlib.util
import itertools
import sys
from itertools import islice
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import max_rel_error
from flax import nnx

from megatrain_jax import streaming
from megatrain_jax.stream.placement import Placement, memory_kinds

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS, CLIP = 10, 0.5  # the gradient norms stay above CLIP: clipping acts at every step


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


example = _load("nnx_scanned")


def _reference(loss_of, params, batches):
    """Plain jax.grad + optax with global-norm clipping: per-step losses and norms, and the
    final parameters."""
    opt = optax.chain(optax.clip_by_global_norm(CLIP), example.optimizer())

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_of)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    opt_state, history = opt.init(params), []
    for batch in batches:
        params, opt_state, loss, norm = step(params, opt_state, batch)
        history.append({"loss": float(loss), "grad_norm": float(norm)})
    return params, history


def _mean_loss(logits, batch):
    return example.summed_loss(logits, batch) / jnp.sum(batch["mask"])


def _check_history(history, ref_history):
    assert len(history) == len(ref_history) == STEPS
    for got, ref in zip(history, ref_history):
        assert got["grad_norm"] > CLIP and ref["grad_norm"] > CLIP  # clipping is active
        np.testing.assert_allclose([got["loss"], got["grad_norm"]],
                                   [ref["loss"], ref["grad_norm"]], rtol=1e-5)


# ----- NNX: the example's model, blocks made by nnx.vmap and applied by nnx.scan ---------


@pytest.fixture(scope="module")
def nnx_run():
    model, step, state, history = example.main(steps=STEPS, clip_norm=CLIP)
    graphdef, params = nnx.split(example.Model(nnx.Rngs(0)), nnx.Param)
    batches = list(islice(example.batches(), STEPS))
    ref_params, ref_history = _reference(
        lambda p, b: _mean_loss(nnx.merge(graphdef, p)(b["inputs"]), b), params, batches)
    return {"model": model, "step": step, "state": state, "history": history,
            "reference": nnx.merge(graphdef, ref_params), "ref_history": ref_history,
            "batch": batches[-1]}


def _nnx_params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_nnx_scanned_model_trains_like_jax_grad(nnx_run):
    _check_history(nnx_run["history"], nnx_run["ref_history"])
    model, reference = nnx_run["model"], nnx_run["reference"]
    assert model.blocks.up.kernel.shape[0] == example.LAYERS  # back in the stacked layout
    assert max_rel_error(_nnx_params(model), _nnx_params(reference)) <= 1e-5
    inputs = nnx_run["batch"]["inputs"]
    assert max_rel_error(model(inputs), reference(inputs)) <= 1e-5  # the user's own forward


def test_nnx_params_to_host_and_an_orbax_checkpoint(nnx_run, tmp_path):
    step, state, reference = nnx_run["step"], nnx_run["state"], nnx_run["reference"]
    fresh = nnx.eval_shape(lambda: example.Model(nnx.Rngs(1)))  # a new model, no arrays yet
    on_host = step.params_to(fresh, state, where="host")
    assert memory_kinds(nnx.state(on_host, nnx.Param)) == {"pinned_host"}
    assert max_rel_error(_nnx_params(on_host), _nnx_params(reference)) <= 1e-5

    path = step.export(state, tmp_path / "trained")
    # What the user's own code does: restore with orbax, put into an abstract model.
    restored = ocp.StandardCheckpointer().restore(path)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: example.Model(nnx.Rngs(2))))
    nnx.replace_by_pure_dict(params, restored)
    model = nnx.merge(graphdef, params)
    inputs = nnx_run["batch"]["inputs"]
    assert max_rel_error(model(inputs), reference(inputs)) <= 1e-5


_COUNTER = itertools.count(1)


def _distinct(key, shape, dtype=jnp.float32):
    """Weights made in NumPy (no random-init program to compile), each parameter distinct."""
    return next(_COUNTER) + np.arange(np.prod(shape), dtype=dtype).reshape(shape) / 64


class _ListModel(nnx.Module):
    """Embed, a list of three blocks, head; weights made in NumPy (nothing to compile)."""

    def __init__(self, rngs, extra=None):
        init = {"kernel_init": _distinct, "bias_init": _distinct}
        self.embed = nnx.Embed(8, 4, embedding_init=_distinct, rngs=rngs)
        blocks = [nnx.Linear(4, 4, **init, rngs=rngs) for _ in range(3)]
        self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
        self.head = nnx.Linear(4, 8, **init, rngs=rngs)
        if extra is not None:
            self.extra = extra(init, rngs)


def test_nnx_list_of_blocks_goes_to_the_store_and_back():
    model = _ListModel(nnx.Rngs(0))
    step = streaming.from_nnx_model(model, example.summed_loss, optax.sgd(0.1))
    state = step.init_state()
    assert len(state.params["layers"]) == 3 and memory_kinds(state.params) == {"pinned_host"}
    back = step.user_params(state, where="host")
    assert set(back["blocks"]) == {0, 1, 2}
    assert max_rel_error(back, _nnx_params(model)) == 0.0


@pytest.mark.parametrize("extra, pieces, message", [
    (lambda init, rngs: nnx.BatchNorm(4, rngs=rngs), {},
     r"_ListModel\.extra\.(mean|var) is an nnx\.BatchStat, not an nnx\.Param"),
    (lambda init, rngs: nnx.Dropout(0.1, rngs=rngs), {},
     r"the RNG stream variable 'extra\.rngs\.\w+' is in none of embed, blocks, head"),
    (lambda init, rngs: nnx.Linear(4, 4, **init, rngs=rngs), {},
     r"parameter 'extra\.(kernel|bias)' is in none of embed, blocks, head"),
    (None, {"head": ("head", "embed")}, r"'embed' is named twice"),
])
def test_nnx_what_the_step_cannot_train_is_refused(extra, pieces, message):
    with pytest.raises(streaming.TemplateError, match=message):
        streaming.from_nnx_model(_ListModel(nnx.Rngs(0), extra), example.summed_loss,
                                 optax.sgd(0.1), **pieces)


# ----- Linen: blocks stacked by nn.scan in setup() --------------------------------------


class LinenBlock(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x, _):  # an nn.scan body: (carry, scanned input) -> (carry, output)
        h = nn.Dense(4 * self.dim)(nn.RMSNorm()(x))
        return x + nn.Dense(self.dim)(nn.gelu(h)), None


class LinenModel(nn.Module):
    def setup(self):
        self.embed = nn.Embed(example.VOCAB, example.DIM)
        self.blocks = nn.scan(LinenBlock, variable_axes={"params": 0},
                              split_rngs={"params": True}, length=example.LAYERS)(example.DIM)
        self.head = nn.Dense(example.VOCAB)

    def __call__(self, tokens):
        x, _ = self.blocks(self.embed(tokens), None)
        return self.head(x)


@pytest.fixture(scope="module")
def linen_run():
    model = LinenModel()
    batches = list(islice(example.batches(), STEPS))
    variables = jax.jit(model.init)(jax.random.key(0), batches[0]["inputs"])
    # Held in host memory, as a model bigger than the GPU would be: sliced there.
    on_host = Placement().to_host(variables)
    step = streaming.from_linen_model(model, on_host, example.summed_loss,
                                      example.optimizer(), clip_norm=CLIP)
    state, history = step.init_state(), []
    for batch in batches:
        state, metrics = step.train_step(state, batch)
        history.append({k: float(metrics[k]) for k in ("loss", "grad_norm")})
    ref_params, ref_history = _reference(
        lambda p, b: _mean_loss(model.apply({"params": p}, b["inputs"]), b),
        variables["params"], batches)
    return {"model": model, "step": step, "state": state, "history": history,
            "variables": variables, "on_host": on_host, "reference": {"params": ref_params},
            "ref_history": ref_history, "batch": batches[-1]}


def test_linen_scanned_model_trains_like_jax_grad(linen_run):
    _check_history(linen_run["history"], linen_run["ref_history"])
    model, reference = linen_run["model"], linen_run["reference"]
    trained = linen_run["step"].params_to(linen_run["variables"], linen_run["state"])
    assert memory_kinds(trained) == {"device"}
    assert trained["params"]["blocks"]["Dense_0"]["kernel"].shape[0] == example.LAYERS
    assert max_rel_error(trained, reference) <= 1e-5
    inputs = linen_run["batch"]["inputs"]
    assert max_rel_error(model.apply(trained, inputs), model.apply(reference, inputs)) <= 1e-5
    # The user's host-held variables were copied, never trained in place.
    assert max_rel_error(linen_run["on_host"], linen_run["variables"]) == 0.0


def test_linen_export_restores_with_orbax(linen_run, tmp_path):
    path = linen_run["step"].export(linen_run["state"], tmp_path / "trained")
    restored = ocp.StandardCheckpointer().restore(path)
    inputs = linen_run["batch"]["inputs"]
    model, reference = linen_run["model"], linen_run["reference"]
    assert max_rel_error(model.apply(restored, inputs), model.apply(reference, inputs)) <= 1e-5


class CompactModel(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(example.VOCAB, example.DIM, name="embed")(tokens)
        x, _ = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=example.LAYERS)(example.DIM, name="blocks")(x, None)
        return nn.Dense(example.VOCAB, name="head")(x)


def test_linen_compact_model_names_its_pieces_with_modules(linen_run):
    """Submodules made in @nn.compact are no attributes: named by (path, module) pairs, they
    give the step the very programs the setup-style model's names give it."""
    model, variables, named = CompactModel(), linen_run["variables"], linen_run["step"]
    with pytest.raises(streaming.TemplateError, match="has no attribute 'embed'"):
        streaming.from_linen_model(model, variables, example.summed_loss, optax.sgd(0.1))
    paired = streaming.from_linen_model(
        model, variables, example.summed_loss, optax.sgd(0.1),
        embed=("embed", nn.Embed(example.VOCAB, example.DIM)),
        blocks=("blocks", LinenBlock(example.DIM)),
        head=("head", nn.Dense(example.VOCAB)))
    assert paired.layout == named.layout
    part = paired.layout.example(variables["params"])
    batch = linen_run["batch"]
    x = jax.ShapeDtypeStruct((*batch["inputs"].shape, example.DIM), jnp.float32)
    for name, args in (("embed", (part["embed"], batch)), ("layer", (part["layer"], x, batch)),
                       ("head_loss", (part["head"], None, x, batch, 1.0))):
        jaxprs = [str(jax.make_jaxpr(getattr(s.engine.templates, name))(*args))
                  for s in (paired, named)]
        assert jaxprs[0] == jaxprs[1], name
