"""Muon over a mesh, for tests/test_muon.py, in a process of its own with N CPU devices.

    python tests/muon_runs.py DEVICES OUT.json

The device count is fixed before JAX starts, so the test runs this as a subprocess: the
streamed trainer with optim.name=muon on the mesh, over the twenty clipped steps of
test_muon's `run` (the first layer resident, the other streamed, the same parameters and
batches). It writes the losses, gradient norms and final weights; the test compares them with
the one-device reference its own process trains.
"""

import json
import os
import sys


def train_on_the_mesh(out_file: str) -> None:
    import jax
    import numpy as np
    from conftest import stream_run, tiny
    from test_muon import MUON, STEPS

    state, losses, norms, _ = stream_run(tiny(*MUON, "stream.resident_layers=1"), STEPS)
    np.savez(f"{out_file}.npz", *[np.asarray(leaf) for leaf in jax.tree.leaves(state.params)])
    result = {"devices": jax.device_count(), "losses": losses, "norms": norms,
              "mesh": len({device for leaf in jax.tree.leaves(state.opt_state)
                           for device in leaf.sharding.device_set}),
              "split": sum(leaf.addressable_shards[0].data.shape != leaf.shape
                           for leaf in jax.tree.leaves(state.opt_state))}
    with open(out_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    devices, out_file = sys.argv[1:]
    flags = os.environ.get("XLA_FLAGS", "")  # the test session's (conftest.py), kept
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(__file__))
    train_on_the_mesh(out_file)
