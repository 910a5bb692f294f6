"""Built-in rates of the machines the planner knows, for when none were measured here.

    machine = preset_for("NVIDIA H200")           # by the GPU's name (nvidia-smi, JAX)
    rates = machine.rates(cfg)                     # roofline.Rates at cfg's shape and batch
    rates = scaled(measured, 4)                    # measured rates at 4x the tokens a step

A preset holds what a step's bound needs from a machine: the link's rates both ways, the
host memory's bandwidth and what the transfers take of the update's, the host AdamW's rate,
the GPU memory's bandwidth, and the GPU's layer speed as a rate of FLOPs, taken from one
measured layer (7b's width at 16 x 1024 tokens) and scaled by each model's FLOPs. `plan
--measure` measures all of them on the machine instead (tools/measure.py); a run records
which it planned with.
"""

from __future__ import annotations

import dataclasses

from megatrain_jax.config import Config, host_update
from megatrain_jax.planning.device_update import device_update_gparams, newton_schulz_seconds
from megatrain_jax.planning.roofline import HOST_UPDATE_BYTES, Rates

# Dense bf16 peak by device kind, for MFU; unknown devices report no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12}

@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    source: str  # where the figures come from: "measured" here, or "published"
    h2d_gbps: float
    d2h_gbps: float
    host_memory_gbps: float
    optimizer_gparams: float  # the host AdamW alone, fp32 moments (device_update.py: others)
    update_loss_h2d: float
    update_loss_d2h: float
    device_memory_gbps: float
    layer_tflops: float  # the rate of a layer's matmuls in its forward, FLOP/s / 1e12
    backward_ratio: float  # a layer's backward with its recompute over its forward
    head_tflops: float  # the head's and the loss's forward and backward, and the embedding's
    # What a step takes beyond its bound (`expected_seconds`): this share of the bound, and
    # this share of the host update's seconds, hidden or not (it draws on the host's memory,
    # the link and the Python thread the GPU waits on). Least squares over 31 runs on six H200
    # machines (benchmarks/RESULTS.md, "Placement" and "Muon": 3b to 14b, 16 x 1024 to
    # 1 x 131072, GPU budgets 24 GiB to the whole GPU): within 5% for 28 of them; the same
    # host-paced placement varied by 14% between machines.
    over_bound: float = 1.047
    host_drag: float = 0.133
    # The rate of the causal attention's forward (cuDNN's), FLOP/s / 1e12: it paces a layer at
    # long rows (7b at 1 x 131072 on the H200: 40.6 s a step).
    attention_tflops: float = 450.0
    # A save (planning/staging.py): the host's copy of host-resident state into the staging
    # area, and the disk's write and read-back of a checkpoint, GB/s. Not yet measured on
    # these machines: the H200 box's figures, assumed for every preset until they are.
    host_copy_gbps: float = 20.0
    disk_write_gbps: float = 1.5
    disk_read_gbps: float = 1.5
    # The layer's matmuls with model.fp8_matmuls over bf16's, their quantization included, in
    # the engine's steps: fitted on the H200 to 7b's and 3b's defaults at 16 x 1024 tokens
    # (17,624 and 34,393 tokens/s measured; 16,980 and 35,922 planned). One layer's forward
    # and backward alone gains more (1.45 at 7b, 1.34 at 3b: benchmarks/bench_fp8.py): a saving
    # layer's backward quantizes again what it recomputes. Assumed for the other FP8 GPUs.
    fp8_speedup: float = 1.3

    def rates(self, cfg: Config, devices: int = 1) -> Rates:
        """The roofline's rates for a step of `cfg` on `devices` of this machine's GPUs (the
        step's rows split over them, each with its own link; one host)."""
        matmuls = layer_flops(cfg) - attention_flops(cfg)
        matmul_tflops = self.layer_tflops * (self.fp8_speedup if cfg.model.fp8_matmuls else 1)
        forward = (matmuls / matmul_tflops + attention_flops(cfg) / self.attention_tflops) \
            / (1e12 * devices)
        return Rates(
            h2d_gbps=self.h2d_gbps * devices, d2h_gbps=self.d2h_gbps * devices,
            layer_forward_s=forward, layer_backward_s=forward * self.backward_ratio,
            head_s=head_flops(cfg) / (self.head_tflops * 1e12 * devices),
            optimizer_gparams=self.optimizer_gparams if host_update(cfg) else
            device_update_gparams(cfg, self.h2d_gbps, self.d2h_gbps, devices),
            overlapped_update=host_update(cfg),
            newton_schulz_s=newton_schulz_seconds(cfg, self.layer_tflops),
            host_memory_gbps=self.host_memory_gbps, update_loss_h2d=self.update_loss_h2d,
            update_loss_d2h=self.update_loss_d2h,
            device_memory_gbps=self.device_memory_gbps * devices)  # each GPU its shard


def layer_flops(cfg: Config) -> float:
    """FLOPs of one layer's forward over the step's tokens: its matmuls, and the causal
    attention's two products over half the scores."""
    m, d = cfg.model, cfg.data
    tokens = d.tokens_per_step
    return 2 * m.params_per_layer * tokens + attention_flops(cfg)


def attention_flops(cfg: Config) -> float:
    """FLOPs of one layer's causal attention forward: QK^T and PV over half the scores."""
    m, d = cfg.model, cfg.data
    return 2 * d.tokens_per_step * d.seq_len * m.heads * m.dh


def head_flops(cfg: Config) -> float:
    """FLOPs of the head's forward and backward over the step's tokens."""
    m = cfg.model
    return 6 * m.vocab_size * m.hidden * cfg.data.tokens_per_step


# Measured on the H200 box (16 cores, PCIe Gen5, 125 GiB host) for 7b at 16 x 1024 tokens:
# forward 10.48 ms and backward 28.9 ms a layer, head and embedding backward 54.0 ms; the link
# 53.3 GB/s each way; host memory about 140 GB/s (117-166 between hosts), the update losing
# 0.19 of its rate beside a copy in and 0.24 beside one out; the host AdamW 5.0 G params/s.
_7B = dict(layer_tflops=651.0, backward_ratio=2.76, head_tflops=238.0)
PRESETS = {
    "H200": Machine("H200", "measured", 53.3, 53.3, 140.0, 5.0, 0.19, 0.24, 4800.0, **_7B),
    # H100 SXM on a PCIe Gen5 host: the same dense bf16 peak as the H200, slower HBM.
    "H100": Machine("H100", "measured", 53.3, 53.3, 140.0, 5.0, 0.19, 0.24, 3350.0,
                    layer_tflops=615.0, backward_ratio=2.76, head_tflops=225.0,
                    attention_tflops=425.0),
    # H100 PCIe: 756 of the SXM's 989 dense bf16 TFLOP/s, 2.0 TB/s HBM.
    "H100 PCIe": Machine("H100 PCIe", "published", 53.3, 53.3, 140.0, 5.0, 0.19, 0.24, 2000.0,
                         layer_tflops=470.0, backward_ratio=2.76, head_tflops=172.0,
                         attention_tflops=325.0),
    # GH200: NVLink-C2C measured at about 375 GB/s to the GPU and 297 back; LPDDR5X about
    # 480 GB/s shared by the update and both copy streams; 72 Grace cores.
    "GH200": Machine("GH200", "published", 375.0, 297.0, 480.0, 15.0, 0.3, 0.3, 4000.0,
                     **_7B),
}
DEFAULT = "H200"
# The machine whose steps set `over_bound` and `host_drag`, which the planner weighs with.
MEASURED = PRESETS[DEFAULT]


def preset_for(device_name: str | None) -> Machine:
    """The preset of a GPU by its name (`NVIDIA H200`, `NVIDIA H100 80GB HBM3`, `NVIDIA
    GH200 480GB`); the H200's where the name is unknown."""
    name = (device_name or "").upper()
    if "GH200" in name:
        return PRESETS["GH200"]
    if "H100" in name:
        return PRESETS["H100 PCIe" if "PCIE" in name else "H100"]
    return PRESETS["H200" if "H200" in name else DEFAULT]


def scaled(rates: Rates, factor: float) -> Rates:
    """The rates at `factor` times the tokens per step: compute scales, transfers do not."""
    return dataclasses.replace(rates, layer_forward_s=rates.layer_forward_s * factor,
                               layer_backward_s=rates.layer_backward_s * factor,
                               head_s=rates.head_s * factor)


def expected_seconds(terms: dict, machine: Machine) -> float:
    """The step a bound's `terms` (roofline.bound's, for one placement and share) should take
    on `machine`: its bound stretched by `over_bound`, plus `host_drag` of the host update's
    seconds beside the GPU's work (an update on the device is inside the bound already).
    Element by element where the terms are arrays."""
    return machine.over_bound * terms["step_s"] + machine.host_drag * terms["host_update_s"]


def expected_step(bound_s: float, measured: dict | None, tokens: int) -> str | None:
    """The bound scaled by the measured run's own step over its bound: what a run at these
    settings should take, extrapolated from the measured one (another depth, batch)."""
    ratio = (measured or {}).get("roofline", {}).get("ratio")
    if not ratio:
        return None
    layers = measured.get("config_values", {}).get("model", {}).get("layers", "?")
    step = bound_s * ratio
    return (f"expected step: {step:.3f} s ({tokens / step:,.0f} tokens/s), extrapolated: the "
            f"bound times {ratio:.3f}, the measured run's step over its bound ({layers} "
            f"layers, {measured['tokens_per_step']:,} tokens per step, "
            f"{measured['median_step_s']:.3f} s)")


def at_optimizer_rate(rates: Rates, gparams: float, kernel_gbps: float,
                      update_bytes: float = HOST_UPDATE_BYTES) -> Rates:
    """`rates` with the optimizer at `gparams` G params/s, and the host memory's bandwidth the
    larger of a streaming kernel's and what a host update at that rate moves through it."""
    moved = gparams * update_bytes if rates.overlapped_update else 0.0
    return dataclasses.replace(rates, optimizer_gparams=gparams,
                               host_memory_gbps=max(kernel_gbps, moved))
