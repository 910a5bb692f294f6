"""Flax models as their users write them, every common pattern trained right or refused.

Each training row runs >= 10 clipped steps against plain jax.grad + optax on the same model
(fp32, rel <= 1e-5 on losses, gradient norms and weights): the GPT example (NNX: tied head,
dropout, a loss mask under its own key, a weight-decay mask function over the whole model),
a Linen GPT (tied head, dropout, a weight-decay mask given as a pytree of the whole model),
and a list-of-blocks NNX model (a mean loss declared, micro-batches, an nnx.State mask).
The other rows are refusals, each naming the entry point, the argument and the fix."""

import importlib.util
import sys
from itertools import islice
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import max_rel_error
from flax import nnx
from nnx_list_model import ListModel, summed_loss

from megatrain_jax import streaming
from megatrain_jax.io.checkpoint import Checkpointer
from megatrain_jax.stream import StreamState
from megatrain_jax.streaming import rng_key

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS, CLIP = 10, 0.5


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpt = _load("nnx_gpt")


def _reference(loss_of, params, batches, optimizer):
    """jax.grad + optax with the global clip in the chain: final params, each step's loss
    and gradient norm. loss_of(params, batch, step) draws its own dropout keys."""
    opt = optax.chain(optax.clip_by_global_norm(CLIP), optimizer)

    @jax.jit
    def step(params, opt_state, batch, index):
        loss, grads = jax.value_and_grad(loss_of)(params, batch, index)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    opt_state, history = opt.init(params), []
    for index, batch in enumerate(batches):
        params, opt_state, loss, norm = step(params, opt_state, batch, index)
        history.append({"loss": float(loss), "grad_norm": float(norm)})
    return params, history


def _check_history(history, ref_history):
    assert len(history) == len(ref_history) >= 10
    clipped = [h["grad_norm"] > CLIP for h in ref_history]
    assert sum(clipped) >= len(clipped) // 2  # clipping acts, on most steps
    for got, ref in zip(history, ref_history):
        np.testing.assert_allclose([got["loss"], got["grad_norm"]],
                                   [ref["loss"], ref["grad_norm"]], rtol=1e-5)


# ----- NNX: the GPT example, trained against its own reference ------------------------


def _gpt_loss(graphdef, rng_state):
    """The GPT's forward with the step's key schedule: the embedding's streams reseeded with
    part 0's key, layer i's with part i + 1's (nnx.scan over the stack, keys scanned)."""

    def loss_of(params, batch, step):
        model = nnx.merge(graphdef, params, rng_state)
        nnx.reseed(model.embed, default=rng_key(0, step, 0))
        keys = jnp.stack([rng_key(0, step, i + 1) for i in range(gpt.LAYERS)])

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def through(x, block, key):
            nnx.reseed(block, default=key)
            return block(x)

        x = through(model.embed(batch["inputs"]), model.blocks, keys)
        logits = model.embed.wte.attend(model.ln_f(x))
        return gpt.summed_loss(logits, batch) / jnp.sum(batch["loss_mask"])

    return loss_of


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    run = gpt.main(steps=STEPS, clip_norm=CLIP, folder=tmp_path_factory.mktemp("gpt"))
    graphdef, params, rng_state = nnx.split(gpt.GPT(nnx.Rngs(0)), nnx.Param, nnx.RngState)
    ref_params, ref_history = _reference(
        _gpt_loss(graphdef, nnx.to_pure_dict(rng_state)), nnx.to_pure_dict(params),
        run["batches"], gpt.optimizer())
    return {**run, "ref_params": ref_params, "ref_history": ref_history}


def test_gpt_example_learns_and_restores(gpt_run):
    losses = [h["loss"] for h in gpt_run["history"]]
    assert np.mean(losses[-3:]) < losses[0] - 1.0
    held_out = gpt_run["held_out"]
    assert gpt.mean_loss(gpt_run["restored"], held_out) == pytest.approx(
        gpt.mean_loss(gpt_run["model"], held_out), rel=1e-6)


def test_nnx_tied_head_dropout_and_masks_train_like_jax_grad(gpt_run):
    """Tied head (the embedding's gradient is the sum of both uses), dropout keys drawn per
    step and layer, batch["loss_mask"] as the loss mask, a decay mask function."""
    _check_history(gpt_run["history"], gpt_run["ref_history"])
    trained = gpt_run["step"].user_params(gpt_run["state"])
    assert max_rel_error(trained, gpt_run["ref_params"]) <= 1e-5
    assert "lm_head" not in trained and "wte" in trained["embed"]  # one matrix, tied


def test_layers_keeping_their_residuals_draw_the_same_dropout_masks(gpt_run):
    """The last layer keeps its matmuls' outputs (keep_layers) and the one before it its
    fetched weights (keep_weights): the saving forward takes the layer's index too, so the
    steps' losses and gradient norms are the reference's."""
    step = gpt.build(gpt.GPT(nnx.Rngs(0)), gpt_run["batches"][0], CLIP, keep_layers=1,
                     keep_weights=1)
    state, history = step.init_state(), []
    for batch in gpt_run["batches"][:3]:
        state, metrics = step.train_step(state, batch)
        history.append([float(metrics["loss"]), float(metrics["grad_norm"])])
    reference = [[h["loss"], h["grad_norm"]] for h in gpt_run["ref_history"][:3]]
    np.testing.assert_allclose(history, reference, rtol=1e-5)


def test_resume_keeps_the_key_schedule(gpt_run, tmp_path):
    """Five steps, a checkpoint, a restored state at step 5, five more: the ten steps'
    weights, dropout masks included (the keys follow StreamState.step)."""
    step, batches = gpt_run["step"], gpt_run["batches"]
    engine = step.engine
    fresh = nnx.to_pure_dict(nnx.state(gpt.GPT(nnx.Rngs(0)), nnx.Param))
    state = engine.state_from_params(step.layout.parts(fresh, engine.placement), copy=False)
    for batch in batches[:5]:
        state, _ = step.train_step(state, batch)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state.step, {"params": state.params, "opt_state": state.opt_state},
              {"step": state.step})
    ckpt.wait()
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state.params)
    tree, meta = ckpt.restore(5, engine.abstract_state(abstract))
    ckpt.close()
    state = StreamState(tree["params"], tree["opt_state"], step=meta["step"])
    for batch in batches[5:]:
        state, _ = step.train_step(state, batch)
    assert max_rel_error(step.user_params(state), gpt_run["ref_params"]) <= 1e-5


# ----- Linen: a GPT-like model, tied head, dropout, a mask pytree, a mean loss ---------

VOCAB, DIM, SEQ, LAYERS, RATE = 64, 16, 8, 2, 0.1


class LinenEmbeddings(nn.Module):
    def setup(self):
        self.wte = nn.Embed(VOCAB, DIM)
        self.wpe = nn.Embed(SEQ, DIM)
        self.drop = nn.Dropout(RATE, deterministic=False)

    def __call__(self, tokens):
        return self.drop(self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[-1])))


class LinenBlock(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x, _):  # an nn.scan body
        h = nn.Dropout(RATE, deterministic=False)(nn.gelu(nn.Dense(2 * self.dim)(
            nn.LayerNorm()(x))))
        return x + nn.Dense(self.dim)(h), None


class LinenGPT(nn.Module):
    def setup(self):
        self.embed = LinenEmbeddings()
        self.blocks = nn.scan(LinenBlock, variable_axes={"params": 0},
                              split_rngs={"params": True, "dropout": True},
                              length=LAYERS)(DIM)
        self.ln_f = nn.LayerNorm()

    def __call__(self, tokens):
        x, _ = self.blocks(self.embed(tokens), None)
        return self.embed.wte.attend(self.ln_f(x))


def _batches(seed=0, rows=4):
    rng = np.random.default_rng(seed)
    while True:
        tokens = rng.integers(0, VOCAB, (rows, SEQ + 1))
        mask = (rng.random((rows, SEQ)) < 0.8).astype(np.float32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _mean_loss(logits, batch):
    """The micro-batch's mean over its kept tokens (declared with reduction="mean")."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])


def _linen_loss(params, batch, step):
    """The loss over the batch's two chunks (its micro-batches), each run with its keys:
    embedding part 0, layer i part i + 1, chunk c (rng_key(seed, step, part, chunk))."""
    total, rows = 0.0, len(batch["inputs"]) // 2
    for chunk in range(2):
        part = {k: v[chunk * rows:(chunk + 1) * rows] for k, v in batch.items()}
        x = LinenEmbeddings().apply({"params": params["embed"]}, part["inputs"],
                                    rngs={"dropout": rng_key(0, step, 0, chunk)})
        for i in range(LAYERS):
            layer = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
            x, _ = LinenBlock(DIM).apply({"params": layer}, x, None,
                                         rngs={"dropout": rng_key(0, step, i + 1, chunk)})
        x = nn.LayerNorm().apply({"params": params["ln_f"]}, x)
        logits = nn.Embed(VOCAB, DIM).apply({"params": params["embed"]["wte"]}, x,
                                            method="attend")
        total = total + summed_loss(logits, part)
    return total / jnp.sum(batch["mask"])


def _kernels(params):
    """A weight-decay mask as a pytree of the whole model: the kernels only."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)


@pytest.fixture(scope="module")
def linen_run():
    model, batches = LinenGPT(), list(islice(_batches(), STEPS))
    variables = jax.jit(model.init)(jax.random.key(1), batches[0]["inputs"])
    optimizer = optax.adamw(3e-2, weight_decay=0.5, mask=_kernels(variables["params"]))
    step = streaming.from_linen_model(
        model, variables, _mean_loss, optimizer, head=("ln_f", "embed.wte.attend"),
        rng_seed=0, reduction="mean", micro_batches=2, clip_norm=CLIP,
        example_batch=batches[0])
    state, history = step.init_state(), []
    for batch in batches:
        state, metrics = step.train_step(state, batch)
        history.append({k: float(metrics[k]) for k in ("loss", "grad_norm")})
    ref_params, ref_history = _reference(_linen_loss, variables["params"], batches, optimizer)
    return {"model": model, "variables": variables, "step": step, "state": state,
            "history": history, "ref_params": ref_params, "ref_history": ref_history,
            "batch": batches[0]}


def test_linen_tied_head_dropout_mask_pytree_and_mean_loss_train_like_jax_grad(linen_run):
    _check_history(linen_run["history"], linen_run["ref_history"])
    trained = linen_run["step"].params_to(linen_run["variables"], linen_run["state"])
    assert max_rel_error(trained["params"], linen_run["ref_params"]) <= 1e-5
    assert set(trained["params"]) == {"embed", "blocks", "ln_f"}  # the head is the table


# ----- refused, naming the entry point, the argument and the fix ----------------------


def _nnx_step(model=None, optimizer=None, loss=summed_loss, **options):
    return streaming.from_nnx_model(model or ListModel(nnx.Rngs(0)), loss,
                                    optimizer or optax.adamw(1e-3), **{"embed": "wte", **options})


def test_a_global_clip_in_the_chain_is_refused_with_the_fix():
    chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    with pytest.raises(streaming.TemplateError, match=r"from_nnx_model\(\): optimizer: its "
                       r"update of '.*' \(.*\) computed part by part differs.*clip_by_global"
                       r"_norm.*pass from_nnx_model\(\.\.\., clip_norm=<max norm>\)"):
        _nnx_step(optimizer=chain)
    _nnx_step(optimizer=optax.chain(optax.clip(1.0), optax.adamw(1e-3)))  # elementwise: fine


def test_optimizer_masks_see_the_whole_model():
    """A mask pytree built from nnx.state(model, nnx.Param) (the form nnx.split gives) lines
    up with every part; one that treats a layer unlike the others is refused."""
    model = ListModel(nnx.Rngs(0))
    mask = jax.tree.map(lambda a: a.ndim > 1, nnx.state(model, nnx.Param))
    _nnx_step(model, optax.adamw(1e-3, weight_decay=0.1, mask=mask))
    uneven = nnx.to_pure_dict(jax.tree.map(lambda a: True, nnx.state(model, nnx.Param)))
    uneven["blocks"][1]["linear"]["kernel"] = False
    with pytest.raises(streaming.TemplateError, match=r"'blocks\.1\.linear\.kernel' \(layer "
                       r"1\).*treats one layer unlike another"):
        _nnx_step(model, optax.adamw(1e-3, weight_decay=0.1, mask=uneven))


def test_the_loss_contract_is_checked_on_one_row():
    batch = next(_batches())
    renamed = {"inputs": batch["inputs"], "targets": batch["targets"],
               "loss_mask": batch["mask"]}
    with pytest.raises(streaming.TemplateError, match=r"from_nnx_model\(\): mask_key='mask': "
                       r"the batch has no 'mask' \(it holds \['inputs', 'loss_mask', "
                       r"'targets'\]\)\. Name the batch's loss mask"):
        _nnx_step(example_batch=renamed)
    with pytest.raises(streaming.TemplateError, match=r"head_loss returns a mean .* but "
                       r"reduction='sum'.*or pass reduction='mean'"):
        _nnx_step(loss=_mean_loss, example_batch=batch)
    with pytest.raises(streaming.TemplateError, match=r"head_loss returns a sum .* but "
                       r"reduction='mean'"):
        _nnx_step(reduction="mean", example_batch=batch)


def test_sibling_embeddings_are_refused_naming_the_piece():
    """Token and position embeddings the model adds are no chain: refused at construction,
    or, without an example batch, at the first step, before any work."""
    model, batch = ListModel(nnx.Rngs(0), positions=True), next(_batches())
    message = (r"from_nnx_model\(\): the model applies 'wpe' to int\d+\[8\], not to the "
               r"output of 'wte' \(float32\[4, 8, 16\]\).*in one module")
    with pytest.raises(streaming.TemplateError, match=message):
        _nnx_step(model, embed=("wte", "wpe"), example_batch=batch)
    step = _nnx_step(model, embed=("wte", "wpe"))
    state = step.init_state()
    with pytest.raises(streaming.TemplateError, match=message):
        step.train_step(state, batch)
    assert state.step == 0


def test_linen_pairs_unlike_the_model_are_refused_naming_the_piece(linen_run):
    """(path, module) pairs, the way to name pieces made in @nn.compact: one built with the
    model's own settings is accepted, one built otherwise refused, by name."""
    batch = linen_run["batch"]

    def step(epsilon):
        return streaming.from_linen_model(
            linen_run["model"], linen_run["variables"], summed_loss, optax.sgd(0.1),
            blocks=("blocks", LinenBlock(DIM)),
            head=[("ln_f", nn.LayerNorm(epsilon)), "embed.wte.attend"], rng_seed=0,
            example_batch=batch)

    step(1e-6)  # the model's own settings: accepted
    with pytest.raises(streaming.TemplateError, match=r"from_linen_model\(\): 'ln_f' computes "
                       r"another function than the model's own 'ln_f'.*model's own settings"):
        step(0.5)


def test_a_mistyped_keyword_names_the_entry_point():
    with pytest.raises(TypeError, match=r"from_nnx_model\(\) got an unexpected keyword "
                       r"argument 'clipnorm' \(did you mean 'clip_norm'\?\)"):
        _nnx_step(clipnorm=1.0)
    with pytest.raises(TypeError, match=r"from_linen_model\(\) got an unexpected keyword "
                       r"argument 'rng_sead' \(did you mean 'rng_seed'\?\)"):
        streaming.from_linen_model(LinenGPT(), {"params": {}}, summed_loss,
                                   optax.sgd(0.1), rng_sead=0)


def test_a_tied_model_given_a_head_it_lacks_is_pointed_at_attend(linen_run):
    """head=("ln_f", "lm_head") on a model whose head is its embedding table: the refusal
    names the method to give instead, the largest table's (the tokens', not positions')."""
    with pytest.raises(streaming.TemplateError, match=r"from_nnx_model\(\): head: GPT has no "
                       r"'lm_head'\. If the model's head is its embedding table \(tied: its "
                       r"__call__ ends in self\.embed\.wte\.attend\(x\)\), name that method: "
                       r"head=\('ln_f', 'embed\.wte\.attend'\)"):
        abstract = nnx.eval_shape(lambda: gpt.GPT(nnx.Rngs(0)))  # no arrays to make
        streaming.from_nnx_model(abstract, gpt.summed_loss, optax.sgd(0.1),
                                 head=("ln_f", "lm_head"), rng_seed=0)
    with pytest.raises(streaming.TemplateError, match=r"from_linen_model\(\): head: LinenGPT "
                       r"has no attribute 'lm_head'.*name that method: "
                       r"head=\('ln_f', 'embed\.wte\.attend'\)"):
        streaming.from_linen_model(linen_run["model"], linen_run["variables"], summed_loss,
                                   optax.sgd(0.1), head=("ln_f", "lm_head"), rng_seed=0)
