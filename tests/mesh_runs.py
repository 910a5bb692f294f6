"""Runs for tests/test_mesh.py, each in a process of its own with N CPU devices.

    python tests/mesh_runs.py DEVICES SCENARIO OUT.json [ARGS...]

The device count must be fixed before JAX starts, so the tests run these as subprocesses:
    compare DIR       20 steps on the mesh (speculating every update, undone where a step
                      clips; none dropped as late) against the one-device reference, the state's
                      shardings, then runs of the training loop in DIR (a straight one, and
                      one that stops at a checkpoint for other device counts to resume), and
                      the host kernel over split leaves against whole ones, and the NNX
                      example's run over four devices
    resume DIR        the stopped run resumed on this process's devices

`single()`, the steps of test_mesh's two-process run in one process, runs in test_mesh's own.
"""

import json
import os
import sys


def _start(devices: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")  # the test session's (conftest.py), kept
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(__file__))


STEPS, STOP = 6, 3
COMPARED = ["model.layers=3", "data.batch_size=8", "data.micro_batches=2", "optim.lr=1e-2",
            "optim.clip_norm=0.6", "schedule.warmup_steps=3"]


def loop_cfg(run_dir, *overrides):
    from conftest import tiny

    return tiny(*COMPARED, f"loop.run_dir={run_dir}", "loop.progress=none", "loop.log_every=1",
                "loop.timeline_step=-1", "loop.tensorboard=off", *overrides)


def metrics(run_dir) -> list[dict]:
    from pathlib import Path

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text()
            .splitlines()]


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def compare(run_dir: str) -> dict:
    import jax
    import numpy as np
    from conftest import max_rel_error, side_by_side, tiny
    from jax.sharding import NamedSharding

    from megatrain_jax.stream import speculation
    from megatrain_jax.stream.mesh import state_spec
    from megatrain_jax.train import machine, train

    out = {"devices": jax.device_count()}
    speculation.DROP_LATE_SPECULATION = False  # every one runs: the test counts them
    resident = ["stream.update=device", "stream.resident_layers=1",
                "stream.resident_embeddings=on", "stream.saved_inputs=pinned_host"]
    for name, extra in (("host", ["stream.speculate=on"]), ("device_resident", resident)):
        cfg = tiny(*COMPARED, "loop.steps=20", *extra)
        ref_state, state, stream, records = side_by_side(cfg, 20 if name == "host" else 6)
        ref_losses, stream_losses, norms = ([r[k] for r in records] for k in (
            "ref_loss", "loss", "grad_norm"))
        placement = stream.engine.placement
        tree = {"params": state.params, "opt_state": state.opt_state}
        homes = [(placement.is_resident(k), leaf)
                 for k, part in enumerate([tree["params"]["embed"], *tree["params"]["layers"],
                                           tree["params"]["head"]])
                 for leaf in jax.tree.leaves(part)]
        out[name] = {
            "losses": stream_losses, "ref_losses": ref_losses, "norms": norms,
            "speculated": [r["speculated"] for r in records],
            "params_rel": max_rel_error(state.params, ref_state.params),
            "mesh": placement.devices,
            "kinds": sorted({leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}),
            "state_kinds": sorted({leaf.sharding.memory_kind
                                   for leaf in jax.tree.leaves(tree["opt_state"])}),
            "streamed_kinds": sorted({leaf.sharding.memory_kind for resident, leaf in homes
                                      if not resident}),
            "not_as_designed": [
                f"{jax.tree_util.keystr(path)}: {leaf.sharding}" for path, leaf
                in jax.tree_util.tree_flatten_with_path(tree)[0]
                if not leaf.sharding.is_equivalent_to(
                    NamedSharding(placement.mesh, state_spec(leaf.shape, jax.device_count()),
                                  memory_kind=leaf.sharding.memory_kind), leaf.ndim)],
            "whole": sorted({str(leaf.shape) for leaf in jax.tree.leaves(tree)
                             if leaf.addressable_shards[0].data.shape == leaf.shape}),
            "host_shard_bytes": int(sum(s.data.nbytes for leaf in jax.tree.leaves(
                tree["params"]) for s in leaf.addressable_shards[:1])),
            "host_bytes": int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree["params"]))),
        }
        if name == "host":
            np.testing.assert_allclose(stream_losses, ref_losses, rtol=1e-5)
            out[name].update(_fetched(stream, state, cfg))
    machine.PEAK_FLOPS["cpu"] = 1e12  # a stand-in peak for each CPU device: MFU is shown
    train(loop_cfg(f"{run_dir}/straight", f"loop.steps={STEPS}"))
    train(loop_cfg(f"{run_dir}/stopped", f"loop.steps={STOP}", f"loop.checkpoint_every={STOP}"))
    out["straight"] = losses(f"{run_dir}/straight")
    out["mfu"] = [(r["mfu"], r["tokens_per_s"]) for r in metrics(f"{run_dir}/straight")]
    out["params"] = loop_cfg(run_dir).model.num_params
    out["kernel_bits_equal"] = _kernel_bits()
    out["kept_weights"] = _kept_weights()
    out["nnx_example"] = _nnx_example()
    return out


def _nnx_example() -> list[str]:
    """The lines `python examples/nnx_scanned.py --steps 6 --devices 4` prints, run here."""
    import contextlib
    import io
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "nnx_scanned.py"
    argv, printed = sys.argv, io.StringIO()
    sys.argv = [str(path), "--steps", "6", "--devices", "4"]
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = argv
    return printed.getvalue().splitlines()


def _kept_weights() -> dict:
    """Four steps on the mesh with every layer keeping its fetched weight shards for the
    backward, against fetching them again: the same bits, and each layer fetched once."""
    import jax
    import numpy as np
    from conftest import Transfers, tiny

    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.train import StreamTrainer

    runs = {}
    for keep in ("off", "on"):
        cfg = tiny(*COMPARED, f"stream.keep_weights={keep}")
        trainer, data, fetches = StreamTrainer(cfg), TokenSource(cfg), Transfers()
        state = trainer.init(jax.random.key(0))
        for step in range(4):
            state, _ = trainer.train_step(state, data.batch_at(step),
                                          tracer=fetches if step == 3 else None)
        state.wait()
        runs[keep] = ([np.asarray(a) for a in jax.tree.leaves((state.params, state.opt_state))],
                      [fetches.h2d.count(f"layer {i}") for i in range(3)],
                      trainer.engine.schedule.keep_weights)
    return {"equal": all(np.array_equal(a, b) for a, b in zip(runs["off"][0], runs["on"][0])),
            "fetches_off": runs["off"][1], "fetches_on": runs["on"][1],
            "kept_layers": runs["on"][2]}


def _kernel_bits() -> dict:
    """The host AdamW over leaves split four ways (along the first dimension, along another,
    not at all) against the same leaves whole on one device: equal bit for bit, for fp32 and
    bf16 gradients and moments, over three updates. The leaves come from NumPy arrays that
    the CPU client would take as buffers (aligned): a leaf given whole to every device must
    still be a buffer a device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from conftest import aligned, normal
    from jax.sharding import Mesh

    from megatrain_jax.optim.host_adamw import HostAdamW
    from megatrain_jax.stream.placement import HOST_KIND, Placement

    shapes = {"rows": (8, 6), "columns": (3, 8), "whole": (3, 5), "vector": (12,)}
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    result = {}
    for grad_dtype in (jnp.float32, jnp.bfloat16):
        for state_dtype in ("float32", "bfloat16"):
            opt = HostAdamW(1e-2, weight_decay=0.1, state_dtype=state_dtype)
            states = []
            for placement in (Placement(), Placement(mesh=mesh)):
                params = {k: aligned(normal(i, shape)) for i, (k, shape) in
                          enumerate(shapes.items())}
                p = placement.place(params, HOST_KIND)
                s = placement.host_jit(opt.optax.init)(p)
                for step in range(3):
                    g = {k: normal(10 * step + i, a.shape, 1e-2).astype(grad_dtype)
                         for i, (k, a) in enumerate(params.items())}
                    g = placement.place(g, HOST_KIND)
                    opt.update(p, g, s, scale=1.0 - 0.1 * step)
                states.append([np.asarray(a).reshape(-1).view(np.uint8)
                               for a in jax.tree.leaves((p, s))])
            result[f"{jnp.dtype(grad_dtype).name} gradients, {state_dtype} moments"] = all(
                np.array_equal(a, b) for a, b in zip(*states))
    return result


def _fetched(stream, state, cfg) -> dict:
    """The bytes one step copies from host to each device, and the bytes of the arrays
    copied: a sharded fetch moves each byte over one link once."""
    import collections

    import jax

    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.stream.trace import Tracer

    per_device, whole = collections.Counter(), [0]

    class Fetches(Tracer):
        def issued(self, lane, name, tree):
            if lane == "h2d":
                for leaf in jax.tree.leaves(tree):
                    whole[0] += leaf.nbytes
                    for shard in leaf.addressable_shards:
                        per_device[shard.device.id] += shard.data.nbytes
            return super().issued(lane, name, tree)

    stream.engine.forward_backward(state.params, TokenSource(cfg).batch_at(0), tracer=Fetches())
    return {"fetched_per_device": sorted(per_device.values()), "fetched_bytes": whole[0]}


def resume(run_dir: str) -> dict:
    import jax

    from megatrain_jax.train import train

    train(loop_cfg(run_dir, f"loop.steps={STEPS}", f"loop.checkpoint_every={STOP}"))
    return {"devices": jax.device_count(), "losses": losses(run_dir)}


def single(steps: int = 4) -> dict:
    import jax
    from conftest import tiny

    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.train import StreamTrainer

    cfg = tiny(*COMPARED, f"loop.steps={steps}")
    trainer, data = StreamTrainer(cfg), TokenSource(cfg)
    state = trainer.init(jax.random.key(0))
    result = []
    for step in range(steps):
        state, metrics = trainer.train_step(state, data.batch_at(step))
        result.append(float(metrics["loss"]))
    return {"devices": jax.device_count(), "processes": jax.process_count(),
            "local_devices": jax.local_device_count(), "losses": result}


if __name__ == "__main__":
    devices, scenario, out_file, *args = sys.argv[1:]
    _start(int(devices))
    result = {"compare": compare, "resume": resume}[scenario](*args)
    with open(out_file, "w") as f:
        json.dump(result, f)
