"""The loss contract: what the head loss returns and what the step divides it by.

    contract = LossContract(mask_key="loss_mask", reduction="sum")
    denom = contract.denominator(batch)                  # the whole batch's: sum of its mask
    loss = contract.scaled(head_loss(...), micro_batch, denom)

The step's loss is a mean over the whole batch, whatever its micro-batches and devices:

- `reduction="sum"` (the default): the head loss returns its micro-batch's loss *summed*
  (over tokens, masked); the step divides by the batch's denominator.
- `reduction="mean"`: the head loss returns its micro-batch's *mean* (over the same tokens);
  the step multiplies it by the micro-batch's denominator, then divides by the batch's.

The denominator is `normalizer(batch)` when given, else the sum of `batch[mask_key]`
(default "mask"; a batch without it is refused, naming its keys), else, with
`mask_key=None`, the number of rows. `check_loss` runs the head loss on one row and on that
row twice, and refuses a loss that does not scale as declared: a sum doubles, a mean stays.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.streaming.errors import TemplateError
from megatrain_jax.streaming.randomness import without_rng_rows

REDUCTIONS = ("sum", "mean")


@dataclasses.dataclass(frozen=True)
class LossContract:
    mask_key: str | None = "mask"
    normalizer: Callable | None = None
    reduction: str = "sum"

    def __post_init__(self):
        if self.reduction not in REDUCTIONS:
            raise TemplateError(f"reduction={self.reduction!r}: must be one of {REDUCTIONS} "
                                "(how head_loss reduces its micro-batch's tokens)")
        if self.normalizer is not None and not callable(self.normalizer):
            raise TemplateError(f"normalizer={self.normalizer!r}: must be a function of the "
                                "batch returning the loss's denominator")

    def denominator(self, batch: dict):
        """The loss's denominator over `batch` (the whole batch, or one micro-batch)."""
        batch = without_rng_rows(batch)
        if self.normalizer is not None:
            return jnp.asarray(self.normalizer(batch), jnp.float32)
        if self.mask_key is None:
            return jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)
        if self.mask_key not in batch:
            raise TemplateError(
                f"mask_key={self.mask_key!r}: the batch has no {self.mask_key!r} (it holds "
                f"{sorted(batch)}). Name the batch's loss mask (mask_key='loss_mask'), pass "
                "normalizer=fn(batch) -> the loss's denominator, or mask_key=None to divide "
                "by the number of rows.")
        return jnp.sum(jnp.asarray(batch[self.mask_key], jnp.float32))

    def scaled(self, loss, micro_batch: dict, denom):
        """One micro-batch's share of the step's loss."""
        if self.reduction == "mean":
            loss = loss * self.denominator(micro_batch)
        return loss / denom


def first_rows(batch: dict, rows: int = 1, start: int = 0) -> dict:
    return {k: np.asarray(v)[start:start + rows] for k, v in batch.items()}


def doubled(batch: dict) -> dict:
    return {k: np.concatenate([v, v]) for k, v in batch.items()}


def counted_row(batch: dict, contract: LossContract) -> dict:
    """The batch's first row whose denominator is not zero (a row whose every token is
    masked out says nothing about the loss), as a one-row batch."""
    rows = len(next(iter(batch.values())))
    for r in range(rows):
        row = first_rows(batch, 1, r)
        if float(contract.denominator(row)) > 0:
            return row
    return first_rows(batch)


def check_loss(once, twice, row: dict, contract: LossContract) -> None:
    """Refuses a head loss that breaks the contract: `once` is its value on `row` (a batch
    of one row), `twice` on that row twice (the same input for each copy)."""
    denom = contract.denominator(row)
    if np.shape(denom) != () or not np.isfinite(float(denom)) or float(denom) < 0:
        raise TemplateError(f"the loss's denominator is {denom} on one row of the batch: it "
                            "must be a finite scalar >= 0 (mask_key, normalizer)")
    if np.shape(once) != ():
        raise TemplateError(f"head_loss returns shape {np.shape(once)}: it must return a "
                            "scalar, the micro-batch's loss reduced over its tokens")
    once, twice = float(once), float(twice)
    if not np.isfinite(once) or abs(once) < 1e-12:
        return  # nothing to learn from a zero or non-finite loss
    ratio = twice / once
    expected = 2.0 if contract.reduction == "sum" else 1.0
    if abs(ratio - expected) <= 1e-3 * expected:
        return
    if contract.reduction == "sum" and abs(ratio - 1.0) <= 1e-3:
        raise TemplateError(
            "head_loss returns a mean (the same loss for a row and for that row twice), but "
            "reduction='sum': return the loss summed over the micro-batch's tokens (the step "
            "divides by the batch's denominator), or pass reduction='mean'.")
    if contract.reduction == "mean" and abs(ratio - 2.0) <= 2e-3:
        raise TemplateError(
            "head_loss returns a sum (twice the loss for a row twice), but reduction='mean': "
            "return the micro-batch's mean, or pass reduction='sum'.")
    raise TemplateError(
        f"head_loss is neither a sum nor a mean over the batch's rows: a row twice gives "
        f"{ratio:.4g} times the loss of the row once (a sum gives 2, a mean 1). Its "
        f"reduction='{contract.reduction}' must match what it returns.")
