"""The in-place host AdamW against `optax.adamw`, kernel by kernel (CPU, fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import normal

from megatrain_jax.optim import apply_update, decay_mask
from megatrain_jax.optim.host_adamw import HostAdamW, writable
from megatrain_jax.stream.placement import Placement

KERNELS = ["numpy"] + (["numba"] if HostAdamW(1e-3).kernel == "numba" else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_host_adamw_matches_optax_bit_for_bit_closely(kernel, weight_decay):
    place = Placement()
    params = {"w": jnp.asarray(normal(0, (70, 33), 0.02)), "norm": jnp.ones(33)}
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)
    opt = HostAdamW(schedule, 0.9, 0.95, 1e-8, weight_decay, decay_mask, kernel=kernel)
    assert opt.kernel == kernel
    ref_params, ref_state = params, opt.optax.init(params)
    host_params, host_state = place.to_host(params), place.to_host(opt.optax.init(params))
    for step in range(7):
        grads = jax.tree.map(lambda p, s=step: jnp.asarray(normal(s, p.shape)), params)
        scale = 0.25 if step % 2 else 1.0
        ref_params, ref_state = apply_update(opt.optax, ref_params, grads, ref_state, scale,
                                             False)
        opt.update(host_params, place.to_host(grads), host_state, scale)
    for ref, got in zip(jax.tree.leaves((ref_params, ref_state)),
                        jax.tree.leaves((host_params, host_state))):
        assert got.sharding.memory_kind == "pinned_host"
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-6, atol=1e-9)
    assert int(host_state[0].count) == 7 and int(host_state[-1].count) == 7


def test_writable_view_writes_into_the_array_without_a_copy():
    array = Placement().to_host(jnp.arange(6, dtype=jnp.float32))
    view = writable(array)
    view *= 2
    np.testing.assert_array_equal(np.asarray(array), 2 * np.arange(6))
    halves = Placement().to_host(jnp.ones(3, jnp.bfloat16))
    bits = writable(halves)  # bf16 as its bits (the view lives only as long as `halves`)
    assert bits.dtype == np.uint16 and list(bits) == [0x3F80] * 3
    with pytest.raises(TypeError, match="float32, int32, bfloat16 and uint8"):
        writable(Placement().to_host(jnp.ones(3, jnp.float16)))


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel must be"):
        HostAdamW(1e-3, kernel="cuda")


def test_the_update_computes_its_scalars_on_the_host_cpu():
    """The learning rate (and compact moments' bias corrections) are computed on the host's
    CPU: on a GPU, the default device, they would queue behind the step's dispatched work."""
    seen = []

    def schedule(count):
        seen.append(jax.config.jax_default_device)
        return 1e-3 * jnp.ones(()) / (1 + count)

    place = Placement()
    params = {"w": jnp.ones((8, 4))}
    for state_dtype in ("float32", "bfloat16"):
        opt = HostAdamW(schedule, 0.9, 0.95, 1e-8, state_dtype=state_dtype)
        p, s = place.to_host(params), place.to_host(opt.optax.init(params))
        opt.update(p, place.to_host(params), s, 1.0)
    assert seen and all(d is not None and d.platform == "cpu" for d in seen), seen
