"""The optimizers beyond their common settings: where each updates, Muon's own settings
(`optim.muon.*`, optax.contrib.muon's arguments at its defaults), and the checks of how the
optimizer goes with the rest of a config.

    cfg = load_config("tiny", ["optim.name=muon", "optim.muon.ns_steps=5"])
    host_update(cfg)              # False: Muon updates through the GPU

Muon orthogonalizes the momentum of each layer's weight matrix by Newton–Schulz iterations;
the embedding, the head, norms and biases take AdamW with optim.b1, optim.b2 and optim.eps
(optim/muon.py builds it).
"""

from __future__ import annotations

from dataclasses import dataclass

# Optimizers with an in-place host kernel (megatrain_jax.optim.host_adamw); the others update
# on the device.
HOST_OPTIMIZERS = ("adamw", "adam")
# optax.contrib.muon's presets of Newton–Schulz coefficients: one triple for every step, or
# dion's five, one a step (which run exactly five steps).
NS_COEFFS = ("standard", "dion")
NS_DTYPES = ("bfloat16", "float32")
DION_STEPS = 5


@dataclass(frozen=True)
class MuonConfig:
    """optax.contrib.muon's settings. optim.weight_decay decays the matrices; optim.b1, b2
    and eps are the AdamW of the other parameters (eps also guards the Newton–Schulz
    normalization, as in optax)."""

    beta: float = 0.95  # the momentum's decay
    ns_steps: int = 5  # Newton–Schulz iterations a matrix a step
    ns_coeffs: str = "standard"
    nesterov: bool = True  # Nesterov momentum, for the matrices and the AdamW alike
    adam_weight_decay: float = 0.0  # AdamW's decay of the embedding, head, norms and biases
    # The AdamW's peak learning rate, on optim.lr's schedule; 0: optim.lr, as optax's muon.
    # A rate fit for the matrices (0.01-0.02) is high for the embedding, head and norms.
    adam_lr: float = 0.0
    # 0: optax's width scaling, sqrt(max(1, fan_out / fan_in)); c > 0: sqrt(max(fan_in,
    # fan_out)) * c, an update of AdamW's RMS at c = 0.2 (optax's consistent_rms).
    consistent_rms: float = 0.0
    # The Newton–Schulz's dtype (optim/muon.py): bfloat16 halves its matmul time on a GPU;
    # float32 is optax.contrib.muon's arithmetic, bit for bit.
    ns_dtype: str = "bfloat16"


def host_update(cfg) -> bool:
    """Whether cfg's optimizer updates the host state in place on the host (stream.update host,
    or auto with a host kernel) rather than through the GPU (stream/engine.py)."""
    return cfg.stream.update != "device" and cfg.optim.name in HOST_OPTIMIZERS


def optimizer_checks(cfg) -> list[tuple[bool, str]]:
    """(ok, message) of each relation between the optimizer's settings and the rest of cfg."""
    o, s = cfg.optim, cfg.stream
    compact = o.state_dtype != "float32"
    checks = [
        (s.update != "host" or o.name in HOST_OPTIMIZERS,
         f"stream.update=host has kernels for optim.name {' and '.join(HOST_OPTIMIZERS)}, not "
         f"'{o.name}'; use stream.update=device (any Optax transformation) or auto"),
        (not compact or o.name in ("adamw", "adam", "muon"),
         f"optim.state_dtype={o.state_dtype} stores Adam's two moments (Muon's momentum): it "
         f"applies to optim.name adamw, adam or muon, not '{o.name}'"),
        (not compact or s.speculate != "on",
         f"stream.speculate=on undoes a clipping step's speculative update exactly, which "
         f"{o.state_dtype} moments (rounded when stored) do not allow: use "
         "stream.speculate=off or auto, or optim.state_dtype=float32"),
    ]
    if o.name != "muon":
        return checks
    return checks + [
        (o.state_dtype in ("float32", "bfloat16"),
         f"optim.state_dtype={o.state_dtype} is a form of Adam's moments; Muon stores its "
         "momentum in float32 or bfloat16 (optax's mu_dtype): set optim.state_dtype to one "
         "of them"),
        (s.speculate != "on",
         "stream.speculate=on runs a speculative host update during the backward; Muon "
         "updates on the GPU after the backward, once the global norm is known, so nothing "
         "is speculative: use stream.speculate=auto or off"),
        (o.muon.ns_coeffs != "dion" or o.muon.ns_steps == DION_STEPS,
         f"optim.muon.ns_coeffs=dion is {DION_STEPS} steps of their own coefficients: set "
         f"optim.muon.ns_steps={DION_STEPS} (got {o.muon.ns_steps})"),
    ]
