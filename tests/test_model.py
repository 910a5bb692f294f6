import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import integers, normal, tiny

from megatrain_jax import model
from megatrain_jax.config import RopeScaling, load_config
from megatrain_jax.model import ops


def _tokens(cfg, b=2, s=16, seed=0):
    return jnp.asarray(integers(seed, (b, s), cfg.model.vocab_size))


def test_output_shapes():
    cfg = tiny()
    params = model.init(cfg.model, jax.random.key(0))
    tokens = _tokens(cfg)
    x = model.embed(params["embed"], tokens, cfg.model)
    assert x.shape == (2, 16, cfg.model.hidden)
    assert model.layer(params["layers"][0], x, cfg.model).shape == x.shape
    assert model.logits(params, tokens, cfg.model).shape == (2, 16, cfg.model.vocab_size)


def test_abstract_matches_init():
    cfg = tiny("model.qkv_bias=true", "model.qk_norm=true")
    params = model.init(cfg.model, jax.random.key(0))
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    assert shapes == jax.tree.map(lambda a: (a.shape, a.dtype), model.abstract(cfg.model))
    n = sum(a.size for a in jax.tree.leaves(params))
    assert n == cfg.model.num_params


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_causal_and_gqa(kv_heads):
    cfg = tiny(f"model.kv_heads={kv_heads}")
    params = model.init(cfg.model, jax.random.key(1))
    tokens = _tokens(cfg)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % cfg.model.vocab_size)
    a = model.logits(params, tokens, cfg.model)
    b = model.logits(params, changed, cfg.model)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])  # earlier positions never see it
    assert float(jnp.max(jnp.abs(a[:, 10:] - b[:, 10:]))) > 1e-4
    assert params["layers"][0].wk.shape == (cfg.model.hidden, kv_heads * cfg.model.dh)


def test_gqa_equals_repeated_kv_heads():
    """kv heads shared by groups of query heads: same as full attention with repeated k/v."""
    q, k, v = normal(0, (2, 8, 4, 16)), normal(1, (2, 8, 2, 16)), normal(2, (2, 8, 2, 16))
    grouped = ops.attention(q, k, v, "xla")
    full = ops.attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), "xla")
    np.testing.assert_allclose(grouped, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("switch, fields", [
    ("model.qkv_bias=true", ("bq", "bk", "bv")),
    ("model.qk_norm=true", ("q_norm", "k_norm")),
])
def test_switches_add_parameters_that_matter(switch, fields):
    base = model.init(tiny().model, jax.random.key(0))["layers"][0]
    assert all(getattr(base, f) is None for f in fields)
    cfg = tiny(switch)
    params = model.init(cfg.model, jax.random.key(0))
    tokens = _tokens(cfg)
    before = model.logits(params, tokens, cfg.model)
    layer = params["layers"][0]
    for f in fields:
        assert getattr(layer, f) is not None
        bumped = jax.tree.map(lambda a: a, layer)
        setattr(bumped, f, getattr(layer, f) + 0.5)
        changed = dict(params, layers=[bumped] + params["layers"][1:])
        after = model.logits(changed, tokens, cfg.model)
        assert float(jnp.max(jnp.abs(after - before))) > 1e-4, f


def test_tied_embeddings_share_the_table():
    cfg = tiny("model.tie_embeddings=true")
    params = model.init(cfg.model, jax.random.key(0))
    assert params["head"].out is None
    assert cfg.model.num_params == sum(a.size for a in jax.tree.leaves(params))
    tokens = _tokens(cfg)
    x = model.embed(params["embed"], tokens, cfg.model)
    for p in params["layers"]:
        x = model.layer(p, x, cfg.model)
    h = ops.rms_norm(x, params["head"].norm, cfg.model.norm_eps)
    expected = h @ params["embed"].table.T
    np.testing.assert_allclose(model.logits(params, tokens, cfg.model), expected, rtol=1e-5,
                               atol=1e-5)


def test_eval_shape_of_70b_allocates_nothing():
    cfg = load_config("llama3-70b")
    shapes = jax.eval_shape(lambda k: model.init(cfg.model, k), jax.random.key(0))
    total = sum(np.prod(s.shape) for s in jax.tree.leaves(shapes))
    assert total == cfg.model.num_params
    assert 70e9 < total < 71e9
    assert len(shapes["layers"]) == 80
    assert shapes["layers"][0].wk.shape == (8192, 8 * 128)


def test_rope_llama3_scaling_keeps_high_and_slows_low_frequencies():
    plain = ops.rope_frequencies(128, 500000.0, RopeScaling())
    scaled = ops.rope_frequencies(128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    np.testing.assert_allclose(scaled[:10], plain[:10])  # short wavelengths untouched
    np.testing.assert_allclose(scaled[-5:], plain[-5:] / 8.0, rtol=1e-6)  # long ones slowed
    assert bool(jnp.all(scaled <= plain + 1e-12))


def test_rope_preserves_norm_and_relative_position():
    x = normal(0, (1, 6, 2, 16))
    inv = ops.rope_frequencies(16, 10000.0, RopeScaling())
    pos = jnp.arange(6)[None]
    rotated = ops.apply_rope(x, pos, inv)
    np.testing.assert_allclose(jnp.linalg.norm(rotated, axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    # the dot product of rotated q and k depends on the offset only
    q = jnp.broadcast_to(x[:, :1], x.shape)
    k = jnp.broadcast_to(x[:, 1:2], x.shape)
    dots = jnp.sum(ops.apply_rope(q, pos, inv)[:, 2:] * ops.apply_rope(k, pos - 2, inv)[:, 2:], -1)
    np.testing.assert_allclose(dots, jnp.broadcast_to(dots[:, :1], dots.shape), rtol=1e-4)


def test_chunked_cross_entropy_equals_full():
    h, w, t = normal(0, (37, 8)), normal(1, (8, 50)), integers(2, (37,), 50)
    m = (np.random.default_rng(3).uniform(size=37) > 0.3).astype(np.float32)
    logits = h @ w
    full = jnp.sum((jax.nn.logsumexp(logits, -1) - logits[jnp.arange(37), t]) * m)
    for chunk in (5, 16, 64):
        np.testing.assert_allclose(ops.chunked_cross_entropy(h, w, t, m, chunk), full, rtol=1e-5)
    g_full = jax.grad(lambda w_: jnp.sum(
        (jax.nn.logsumexp(h @ w_, -1) - (h @ w_)[jnp.arange(37), t]) * m))(w)
    g_chunk = jax.grad(lambda w_: ops.chunked_cross_entropy(h, w_, t, m, 8))(w)
    np.testing.assert_allclose(g_chunk, g_full, rtol=1e-5, atol=1e-6)


def test_stack_and_unstack_layers_round_trip():
    params = model.init(tiny("model.layers=3").model, jax.random.key(0))
    stacked = model.stack_layers(params["layers"])
    assert stacked.wq.shape[0] == 3
    back = model.unstack_layers(stacked)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params["layers"])):
        np.testing.assert_array_equal(a, b)


def test_bf16_compute_keeps_fp32_masters():
    cfg = tiny("model.compute_dtype=bfloat16")
    params = model.init(cfg.model, jax.random.key(0))
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    x = model.embed(params["embed"], _tokens(cfg), cfg.model)
    assert model.layer(params["layers"][0], x, cfg.model).dtype == jnp.bfloat16


def test_choose_is_greedy_at_temperature_0_and_draws_within_top_p():
    from megatrain_jax.model.decode import choose

    logits = jnp.log(jnp.asarray([[0.1, 0.5, 0.3, 0.1]]))
    keys = jax.random.split(jax.random.key(0), 400)
    draws = jax.jit(jax.vmap(lambda k, t, p: choose(logits, k, t, p)[0],
                             in_axes=(0, None, None)))
    counts = [np.bincount(np.asarray(draws(keys, t, p)), minlength=4)
              for t, p in ((0.0, 1.0), (1.0, 0.7), (1.0, 1.0), (1.0, 0.01))]
    assert counts[0][1] == 400 and counts[3][1] == 400  # the most likely token only
    assert counts[1][0] == counts[1][3] == 0 and counts[1][2] > 80  # 0.5 + 0.3 reach 0.7
    assert min(counts[2]) > 15 and 160 < counts[2][1] < 240  # every token, as likely as given
