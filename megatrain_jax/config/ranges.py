"""The valid range of every numeric setting, in one table, checked before anything is built.

    check_ranges(cfg)      # raises ConfigError: "optim.b1 (1.5) must be within [0, 1)."

A range is written as an interval: `[0, 1)` takes 0 and not 1, `(0, inf)` anything above 0.
Relations between settings (heads dividing evenly, layers kept within model.layers, ...) are
`schema.validate`'s; it checks this table first, so that none of them ever divides by a zero
or a negative size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatrain_jax.config.auto import MAX_POSITION
from megatrain_jax.config.errors import ConfigError

INF = math.inf
SEED_END = 2**63  # seeds go to NumPy and JAX as 64-bit integers


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    low_closed: bool = True
    high_closed: bool = False

    @classmethod
    def parse(cls, text: str) -> "Interval":
        """`[0, 1)`, `(0, inf)`, ... (inf for an open end)."""
        low, high = (float(part) for part in text[1:-1].split(","))
        return cls(low, high, text[0] == "[", text[-1] == "]")

    def __contains__(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False  # inf and NaN are never a setting
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def __str__(self) -> str:
        def number(x: float) -> str:
            return f"{int(x)}" if x == int(x) and abs(x) < 1e20 else f"{x:g}"

        if self.high == INF:
            return f"{'>=' if self.low_closed else '>'} {number(self.low)}"
        return (f"within {'[' if self.low_closed else '('}{number(self.low)}, "
                f"{number(self.high)}{']' if self.high_closed else ')'}")


# key: (interval, what the edges mean, when that helps). Every int and float field of the
# schema has a line; a test holds the table to that.
RANGES: dict[str, tuple[str, str]] = {
    "model.vocab_size": ("[1, inf)", ""),
    "model.hidden": ("[1, inf)", ""),
    "model.layers": ("[1, inf)", ""),
    "model.heads": ("[1, inf)", ""),
    "model.kv_heads": ("[1, inf)", ""),
    "model.head_dim": ("[0, inf)", "0: model.hidden / model.heads"),
    "model.ffn": ("[1, inf)", ""),
    "model.rope_theta": ("(0, inf)", ""),
    "model.rope_scaling.factor": ("(0, inf)", ""),
    "model.rope_scaling.low_freq_factor": ("(0, inf)", ""),
    "model.rope_scaling.high_freq_factor": ("(0, inf)", ""),
    "model.rope_scaling.original_max_position": ("[1, inf)", ""),
    "model.norm_eps": ("(0, inf)", ""),
    "model.max_seq_len": (f"[1, {MAX_POSITION}]", "rotary angles are exact below 2**24 "
                          "positions"),
    "model.init_std": ("(0, inf)", ""),
    "optim.lr": ("(0, inf)", ""),
    "optim.b1": ("[0, 1)", ""),
    "optim.b2": ("[0, 1)", ""),
    "optim.eps": ("(0, inf)", ""),
    "optim.weight_decay": ("[0, inf)", ""),
    "optim.momentum": ("[0, 1)", ""),
    "optim.clip_norm": ("[0, inf)", "0 turns clipping off"),
    "optim.muon.beta": ("[0, 1)", ""),
    "optim.muon.ns_steps": ("[1, inf)", ""),
    "optim.muon.adam_weight_decay": ("[0, inf)", ""),
    "optim.muon.adam_lr": ("[0, inf)", "0: optim.lr"),
    "optim.muon.consistent_rms": ("[0, inf)", "0: optax's width scaling"),
    "schedule.warmup_steps": ("[0, inf)", ""),
    "schedule.decay_steps": ("[0, inf)", "0: until loop.steps"),
    "schedule.min_lr_ratio": ("[0, 1]", ""),
    "data.batch_size": ("[1, inf)", ""),
    "data.seq_len": ("[1, inf)", ""),
    "data.micro_batches": ("[1, inf)", ""),
    "data.seed": (f"[0, {SEED_END})", ""),
    "data.val_fraction": ("[0, 1)", ""),
    "stream.prefetch_depth": ("[1, inf)", ""),
    "stream.loss_chunk": ("[1, inf)", ""),
    "stream.host_memory_gb": ("[0, inf)", "0: sized from the model"),
    "stream.gpu_budget_gb": ("[0, inf)", "0: what XLA may allocate on each GPU"),
    "stream.speculate_share": ("(0, 1]", "stream.speculate=off speculates nothing"),
    "stream.mlp_tile": ("[0, inf)", "0: automatic"),
    "stream.attention_chunk": ("[0, inf)", "0: automatic"),
    "mesh.data": ("[0, inf)", "0: every device"),
    "loop.steps": ("[1, inf)", ""),
    "loop.seed": (f"[0, {SEED_END})", ""),
    "loop.log_every": ("[1, inf)", ""),
    "loop.checkpoint_every": ("[0, inf)", "0: none"),
    "loop.keep_checkpoints": ("[1, inf)", ""),
    "loop.max_skipped_steps": ("[1, inf)", ""),
    "loop.timeline_step": ("[-1, inf)", "-1: none"),
    "loop.eval_every": ("[0, inf)", "0: none"),
    "loop.eval_batches": ("[1, inf)", ""),
}


def value_at(cfg, key: str):
    """The value of `section.key` (or `section.sub.key`) in a Config."""
    value = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return value


def check_ranges(cfg) -> None:
    """Raises ConfigError for the first setting outside its range, naming the key, its value
    and the range."""
    for key, (text, meaning) in RANGES.items():
        value, interval = value_at(cfg, key), Interval.parse(text)
        if value not in interval:
            note = f" ({meaning})" if meaning else ""
            raise ConfigError(f"{key} ({value}) must be {interval}{note}.")
