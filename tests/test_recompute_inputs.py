"""Recomputed inputs (`stream.recompute_inputs`): layers whose forward saves no input, the
backward running the forward again from the last input saved before them (CPU)."""

import jax
import numpy as np
import pytest
from conftest import Transfers, max_rel_error, tiny

from megatrain_jax import model, optim
from megatrain_jax.io.data import TokenSource
from megatrain_jax.stream import StreamEngine
from megatrain_jax.stream.schedule import recomputed_inputs
from megatrain_jax.train.trainers import llama_templates

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
        (("recompute_inputs", 2), ("resident_layers", 1)):  # layer 0's input alone travels
            ["layer 2", "layer 3", "layer 2", "layer 1", "layer 0"],
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
