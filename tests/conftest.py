"""Shared helpers: tiny configs in fp32 on the CPU, leaf-by-leaf comparison, and a
persistent compilation cache for the session (the tests train the same tiny models many
times).

The tests' programs are compiled without LLVM's optimizations (FAST_COMPILE): compiling, not
running, is most of a tiny model's time, and unoptimized code takes about a third less
compiling. The values differ from an optimized build's in the last bits; the streamed step and
the reference it is compared with are compiled alike. The processes the tests start get the
flag through the environment; runs of several processes get SEVERAL_PROCESSES."""

import os
import socket

FAST_COMPILE = "--xla_backend_optimization_level=0"
# Runs of several processes skip only LLVM's most expensive passes, as the whole suite once
# did: a run of two processes compiled as above stopped making progress twice in about seventy
# runs (both times beside other tests' load), and none compiled this way has been seen to. The
# cause is not known.
SEVERAL_PROCESSES = "--xla_llvm_disable_expensive_passes=true"
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):  # read when the CPU backend starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from megatrain_jax.config import load_config  # noqa: E402
from megatrain_jax.stream.trace import Tracer  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def tiny(*overrides):
    """The shipped tiny config in fp32, with overrides."""
    return load_config("tiny", ["model.compute_dtype=float32", *overrides])


# Twenty steps of three layers and two micro-batches that clip on some steps and not on
# others: the tests that train a feature against the reference share it where they can, so
# that the reference's step (and the layer programs) compile once for all of them.
CLIPPED = ["model.layers=3", "data.batch_size=4", "data.micro_batches=2", "loop.steps=20",
           "optim.lr=1e-2", "optim.clip_norm=1.0", "schedule.warmup_steps=3"]


class Transfers(Tracer):
    """The names of the host-to-device copies a step issues, in order (`h2d`)."""

    def __init__(self):
        super().__init__()
        self.h2d: list[str] = []

    def issued(self, lane, name, tree):
        if lane == "h2d":
            self.h2d.append(name)
        return super().issued(lane, name, tree)


def process_env(xla_flags: str = FAST_COMPILE) -> dict:
    """The environment of a process a test starts: this checkout's code first on the path, on
    the CPU with `xla_flags`, and the test session's compilation cache (compilation_cache
    below), every program kept: the processes build the programs the tests build."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags,
            "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "JAX_COMPILATION_CACHE_DIR": str(jax.config.jax_compilation_cache_dir or ""),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def free_port() -> int:
    """A port no one listens on now, for a coordinator of several processes."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def normal(seed: int, shape, scale: float = 1.0) -> np.ndarray:
    """float32 numbers from a standard normal (times `scale`), drawn by NumPy: test inputs
    with no random-number program to compile for every shape."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def integers(seed: int, shape, high: int) -> np.ndarray:
    """int32 numbers in [0, high), drawn by NumPy."""
    return np.random.default_rng(seed).integers(0, high, shape, dtype=np.int32)


def aligned(a) -> np.ndarray:
    """A copy of `a` whose data starts on a 64-byte boundary: the CPU client takes such an
    array as the placed array's own buffer unless the library copies it."""
    a = np.asarray(a)
    raw = np.empty(a.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def max_rel_error(a, b) -> float:
    """max over leaves of max|a - b| / max|b| (trees of equal structure)."""
    errors = jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        / max(float(np.max(np.abs(np.asarray(y)))), 1e-30),
        a, b,
    )
    return max(jax.tree.leaves(errors))


def stream_run(cfg, steps: int):
    """The streamed trainer over `steps` batches from model.init's parameters (key 0), as
    side_by_side starts it: (final state, losses, gradient norms, each step's metrics)."""
    from megatrain_jax import model
    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.train import StreamTrainer

    data, trainer = TokenSource(cfg), StreamTrainer(cfg)
    state = trainer.init(None, params=model.init(cfg.model, jax.random.key(0)))
    losses, norms, records = [], [], []
    for step in range(steps):
        state, m = trainer.train_step(state, data.batch_at(step))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        records.append(m)
    return state.wait(), losses, norms, records


def side_by_side(cfg, steps: int):
    """The reference and the streamed trainer over the same `steps` batches from the same
    parameters: (reference state, streamed state, the streamed trainer, a record per step)."""
    from megatrain_jax import model
    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.train import StreamTrainer
    from megatrain_jax.train.reference import ReferenceTrainer

    data = TokenSource(cfg)
    params = model.init(cfg.model, jax.random.key(0))
    ref, stream = ReferenceTrainer(cfg), StreamTrainer(cfg)
    ref_state, state = ref.init(None, params=params), stream.init(None, params=params)
    records = []
    for step in range(steps):
        batch = data.batch_at(step)
        ref_state, rm = ref.train_step(ref_state, batch)
        state, m = stream.train_step(state, batch)
        records.append({"ref_loss": float(rm["loss"]), "loss": float(m["loss"]),
                        "grad_norm": float(m["grad_norm"]), "ref_lr": float(rm["lr"]),
                        "lr": float(m["lr"]),
                        "speculated": int(m.get("speculated_parts", 0)),
                        "undone": int(m.get("undone_parts", 0))})
    return ref_state, state, stream, records


def agrees_with_reference_while_clipping(cfg, steps: int):
    """side_by_side over `steps` batches, asserting that clipping at cfg.optim.clip_norm
    triggered on some steps and not on others, and that the streamed trainer agreed with the
    reference (losses rtol 1e-5, parameters rel <= 1e-5). Returns the streamed trainer and
    the records."""
    ref_state, state, stream, records = side_by_side(cfg, steps)
    clip, norms = cfg.optim.clip_norm, [r["grad_norm"] for r in records]
    assert any(n > clip for n in norms) and any(n < clip for n in norms), norms
    np.testing.assert_allclose([r["loss"] for r in records],
                               [r["ref_loss"] for r in records], rtol=1e-5)
    assert max_rel_error(state.params, ref_state.params) <= 1e-5
    return stream, records


@pytest.fixture
def tiny_config():
    return tiny


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """A persistent compilation cache private to the test session: every trainer builds its
    own programs, and the many tests that train the same tiny models would compile them
    again (about 30 s for the tiny model on 2 busy cores); with the cache, later compiles
    are loads (about 3 s). Under pytest-xdist the session's workers share one cache (the
    folder above their own), so a program one worker compiled is a load for the other.
    Tests that count compilations use shapes no other test uses."""
    from jax.experimental.compilation_cache import compilation_cache as cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in names}
    cache.reset_cache()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the session's folder, beside the workers'
        folder = tmp_path_factory.getbasetemp().parent / "jax_cache"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("jax_cache")
    for name, value in zip(names, (str(folder), 0, 0)):
        jax.config.update(name, value)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    cache.reset_cache()
