"""Muon over a mesh, for tests/test_muon.py, in a process of its own with N CPU devices.

    python tests/muon_runs.py DEVICES OUT.json

The device count is fixed before JAX starts, so the test runs this as a subprocess: the
streamed trainer with optim.name=muon on the mesh against the one-device reference, over
twenty clipped steps, the first layer resident and the other streamed.
"""

import json
import os
import sys


def compare() -> dict:
    import jax
    from conftest import max_rel_error, side_by_side, tiny
    from test_muon import MUON

    out = {"devices": jax.device_count()}
    for name, extra in (("resident", ["stream.resident_layers=1"]),):
        cfg = tiny(*MUON, "data.batch_size=8", "data.micro_batches=2", *extra)
        ref_state, state, stream, records = side_by_side(cfg, 20)
        out[name] = {
            "losses": [r["loss"] for r in records], "ref_losses": [r["ref_loss"] for r in records],
            "norms": [r["grad_norm"] for r in records],
            "params_rel": max_rel_error(state.params, ref_state.params),
            "mesh": stream.engine.placement.devices,
            "split": sum(leaf.addressable_shards[0].data.shape != leaf.shape
                         for leaf in jax.tree.leaves(state.opt_state)),
        }
    return out


if __name__ == "__main__":
    devices, out_file = sys.argv[1:]
    flags = os.environ.get("XLA_FLAGS", "")  # the test session's (conftest.py), kept
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(__file__))
    with open(out_file, "w") as f:
        json.dump(compare(), f)
