"""Shared helpers: tiny configs in fp32 on the CPU, and leaf-by-leaf comparison."""

import jax
import numpy as np
import pytest

from megatrain_jax.config import load_config

jax.config.update("jax_platforms", "cpu")


def tiny(*overrides):
    """The shipped tiny config in fp32, with overrides."""
    return load_config("tiny", ["model.compute_dtype=float32", *overrides])


def max_rel_error(a, b) -> float:
    """max over leaves of max|a - b| / max|b| (trees of equal structure)."""
    errors = jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        / max(float(np.max(np.abs(np.asarray(y)))), 1e-30),
        a, b,
    )
    return max(jax.tree.leaves(errors))


@pytest.fixture
def tiny_config():
    return tiny
