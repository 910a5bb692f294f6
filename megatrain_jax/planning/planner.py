"""The placement planner: one decision, made once before the engine is built, of where each
part's state and each layer's activations live, under a GPU budget and a host budget.

    planned = plan_placement(cfg, gpu=134 * GiB, host=125 * GiB, devices=1, rates=rates)
    planned.plan            # memory.PlacementPlan: resident, saving, keeping layers, ...
    planned.step_s          # the bound it minimizes; planned.device, planned.host_total
    cfg = resolve(cfg, gpu, host, devices, rates)   # every `auto` placement key pinned

The choices (memory.PlacementPlan): the first R layers' state resident on the GPU (updated
there: no host update, no transfers for them), the embedding and head resident or not, the
last S layers saving their activations (no recompute), A layers before those keeping their
attention (rows of auto.KEEP_ATTENTION_FROM tokens or more), W streamed layers keeping the
weights their forward fetched, the first H layers' saved inputs waiting on the host, and D
layers saving no input at all (the backward runs their forward again: planning/recompute.py).

What a byte of GPU room buys is read off the step's bound (planning/roofline.py): resident state
removes its share of the host update, of the host memory's traffic and of both transfers;
saved activations remove most of a forward from a layer's backward; kept attention the
attention's forward; kept weights one weight pass through the link and the host memory;
inputs kept on the GPU their two trips. The planner searches every (R, S, embeddings, A) the
budgets and pins allow, at once as arrays; for each it keeps inputs on the GPU as far as the
room allows and fills the rest with kept weights, which is never worse: an input byte on the
GPU saves at least the link and host memory bytes a kept-weight byte saves (its trip back in
the backward) and also its trip out in the forward. Where the host cannot hold the inputs
left to it, it recomputes the fewest with which it can (one more layer forward each, in the
bound). It minimizes the mean of two bounds: a
step that clips (no update during the backward: every step of a fresh run or a fine-tune)
and one that does not (tests/test_planner.py checks this against exhaustive search). Ties go
to more resident and saving layers: the GPU's room is part of the home.

A placement key set in the config (a number, on or off) pins that choice; the planner places
the rest around it. An unknown GPU budget (a CPU) places nothing on the GPU but the step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatrain_jax.config import HOST_OPTIMIZERS, Config, ConfigError, auto
from megatrain_jax.config.schema import pinned
from megatrain_jax.planning import memory, pool, presets, recompute, roofline, staging
from megatrain_jax.planning.bisection import least, most
from megatrain_jax.planning.memory import HEADROOM, PlacementPlan

GiB = 2**30
# The planner weighs each placement at the given rates and at a host this much slower (its
# memory and its update): the same kind of host varies by about a third between machines
# (117-166 GB/s), and a placement the host barely keeps pace with is the first to lose.
SLOWER_HOST = 0.8


@dataclasses.dataclass(frozen=True)
class Planned:
    """A placement with what the planner predicts of it."""

    plan: PlacementPlan
    step_s: float  # what the planner minimizes: the mean of the two bounds below, at the
    # rates and at a slower host (SLOWER_HOST)
    clipping_s: float  # a step that clips: the update after the backward
    speculating_s: float  # a step that does not: the best share of it during the backward
    limited_by: str  # the largest cost of the step that clips
    device: dict  # each GPU's bytes by component
    host_total: int  # the host's bytes, state and overhead
    gpu_budget: int | None  # the room it was fitted in (None: unknown)


def plan_placement(cfg: Config, gpu: int | None, host: int | None, devices: int,
                   rates: roofline.Rates) -> Planned:
    """The placement of cfg's streamed step that minimizes its bound at `rates`, within
    `gpu` bytes of each of `devices` GPUs (None: unknown, nothing placed there) and `host`
    bytes of host memory (None: unknown, unbounded). Refuses, with the numbers, where no
    placement fits."""
    grid = _candidates(cfg, gpu, devices, host)
    fitting = grid["device_total"] <= (np.inf if gpu is None else gpu - HEADROOM)
    fitting &= grid["host_total"] <= (np.inf if host is None else host)
    fitting &= _keeps_pins(cfg, grid)
    if not fitting.any():
        raise ConfigError(_refusal(cfg, grid, gpu, host))
    grid = {name: values[fitting] for name, values in grid.items()}
    objective = score(cfg, grid, rates, devices)
    best = objective.min()
    tied = np.flatnonzero(objective <= best * (1 + 1e-9))
    order = np.lexsort(tuple(-grid[key][tied] for key in reversed(_TIE_ORDER)))
    k = tied[order[0]]
    plan = _plan_at(grid, k)
    clipping, speculating, _ = _bounds(cfg, plan, rates, devices)  # the chosen one's
    limited = roofline.bound_of(cfg, plan, rates, devices)["limited_by"]
    return Planned(plan, float(objective[k]), float(clipping), float(speculating), limited,
                   memory.device_bytes(cfg, plan, devices),
                   int(grid["host_total"][k]), gpu)


def score(cfg: Config, placement, rates: roofline.Rates, devices: int):
    """What the planner minimizes for a placement (a PlacementPlan, or a grid of candidates:
    one score each): the step expected of it (presets.expected_seconds), from the mean of the
    bounds of a step that clips and of one that does not, at `rates` and at a host
    SLOWER_HOST as fast. The host update's drag counts even where the bound hides it, so
    that where bounds tie, the placement that leaves more of the state on the GPU wins."""
    slow = dataclasses.replace(rates, host_memory_gbps=rates.host_memory_gbps * SLOWER_HOST,
                               optimizer_gparams=rates.optimizer_gparams * SLOWER_HOST)
    clipping, speculating, host_update = _bounds(cfg, placement, rates, devices)
    slow_clipping, slow_speculating, _ = _bounds(cfg, placement, slow, devices)
    bounds = (clipping + speculating + slow_clipping + slow_speculating) / 4
    return presets.expected_seconds({"step_s": bounds, "host_update_s": host_update},
                                    presets.MEASURED)


def _keeps_pins(cfg: Config, grid: dict):
    """Which candidates hold the pinned counts the layout could otherwise cut short: kept
    weights (within the streamed layers fetched twice) and kept attention (within the layers
    that do not save)."""
    s, ok = cfg.stream, np.ones_like(grid["resident_layers"], dtype=bool)
    if s.keep_weights.isdigit():
        ok &= grid["weight_layers"] == int(s.keep_weights)
    if s.keep_attention.isdigit():
        ok &= grid["attention_layers"] == int(s.keep_attention)
    plain = recompute.plain_layers(cfg, PlacementPlan(**{k: grid[k] for k in _PLAN_KEYS}))
    return ok & (grid["recomputed_inputs"] < np.maximum(plain, 1))  # a pin the layout allows


def host_total(cfg: Config, plan: PlacementPlan, devices: int):
    """Host bytes of a run under `plan` (arrays in its fields give arrays): its state (in the
    pinned pool or beside it: pool.pooled), the run's overhead (pool.host_overhead) and
    the save's staging area, at least its largest part where the planner sizes it
    (planning/staging.py)."""
    host = memory.host_state_bytes(cfg, plan, devices)
    state, pinned = sum(host.values()), pool.pooled(cfg, host)
    total = state + sum(pool.host_overhead(cfg, pinned, devices, state - pinned).values())
    return total + staging.staged_bytes(cfg)


def closest(cfg: Config, gpu: int | None, devices: int) -> PlacementPlan:
    """Where no placement fits: the one that needs the least host memory among those that fit
    the GPU, or the least GPU memory where none does (what `plan` shows the numbers of)."""
    grid = _candidates(cfg, gpu, devices, host=0)  # each recomputing all it may: its least
    on_gpu = grid["device_total"] <= (np.inf if gpu is None else gpu - HEADROOM)
    need = np.where(on_gpu, grid["host_total"], np.inf) if on_gpu.any() else grid["device_total"]
    return _plan_at(grid, _least_needing(need, grid))


def _least_needing(need, grid: dict) -> int:
    """The candidate that needs least, of those that need as little the one recomputing the
    fewest inputs (recomputing buys bytes only where they are short)."""
    return int(np.lexsort((grid["recomputed_inputs"], need))[0])


def _plan_at(grid: dict, k: int) -> PlacementPlan:
    plan = PlacementPlan(**{key: int(grid[key][k]) for key in _PLAN_KEYS})
    return dataclasses.replace(plan, resident_embeddings=bool(plan.resident_embeddings))


_PLAN_KEYS = ("resident_layers", "resident_embeddings", "saving_layers", "attention_layers",
              "weight_layers", "host_inputs", "recomputed_inputs")
_TIE_ORDER = ("resident_layers", "saving_layers", "resident_embeddings", "attention_layers",
              "weight_layers")


def resolve(cfg: Config, gpu: int | None, host: int | None, devices: int,
            rates: roofline.Rates) -> Config:
    """cfg with every placement key the planner's choice (or as pinned), the save's staging
    area too: whole where the host has room for it beside the rest, else the largest parts
    that fit. Where every placement key is pinned, only the staging area is decided."""
    if _placement_pinned(cfg):
        total = host_total(cfg, memory.plan_of(cfg), devices)
        room = None if host is None else host - total + staging.staged_bytes(cfg)
        return memory.replaced(cfg, "stream", save_staging=staging.decide(cfg, room))
    planned = plan_placement(cfg, gpu, host, devices, rates)
    room = None if host is None else host - planned.host_total + staging.staged_bytes(cfg)
    return pinned_config(cfg, planned.plan, staging.decide(cfg, room))


def is_resolved(cfg: Config) -> bool:
    """Whether every placement key of cfg and its staging area are set (by the planner or
    by the user)."""
    return _placement_pinned(cfg) and cfg.stream.save_staging != "auto"


def _placement_pinned(cfg: Config) -> bool:
    try:
        memory.plan_of(cfg)
    except ValueError:
        return False
    return True


def gpu_budget(cfg: Config, usable: int | None) -> int | None:
    """Each GPU's bytes the placement fills: stream.gpu_budget_gb where set (the user's word,
    even beyond what XLA's share of the GPU is estimated to hold: the estimate errs high
    where activations are saved), else what XLA may allocate (None: unknown)."""
    if not cfg.stream.gpu_budget_gb:
        return usable
    return int(cfg.stream.gpu_budget_gb * GiB)


def pinned_config(cfg: Config, plan: PlacementPlan, save_staging: str = "whole") -> Config:
    """cfg with its placement keys set to `plan` and the save's staging area to
    `save_staging` where it is `auto`: the engine's numbers, nothing left auto."""
    if cfg.stream.save_staging != "auto":
        save_staging = cfg.stream.save_staging
    return memory.replaced(
        cfg, "stream", save_staging=save_staging, resident_layers=str(plan.resident_layers),
        resident_embeddings="on" if plan.resident_embeddings else "off",
        keep_layers=str(plan.saving_layers), keep_attention=str(plan.attention_layers),
        keep_weights=str(plan.weight_layers), recompute_inputs=str(plan.recomputed_inputs),
        saved_inputs="device" if plan.host_inputs == 0 else str(plan.host_inputs))


# ----- the search ------------------------------------------------------------------------


def _options(value: str, auto_range: range, words: dict | None = None) -> np.ndarray:
    """A placement key's values to search: its pin, or every value of `auto_range`."""
    count = pinned(value)
    if count is not None:
        return np.array([count])
    if words and value in words:
        return np.array([words[value]])
    return np.array(list(auto_range))


def _candidates(cfg: Config, gpu: int | None, devices: int, host: int | None = None) -> dict:
    """Every placement the pins allow as arrays, one element a placement, with their inputs,
    recomputed inputs (where `host` bytes are known) and kept weights filled into each one's
    room, and their bytes."""
    s, layers, known = cfg.stream, cfg.model.layers, gpu is not None
    room_for = range(layers + 1) if known else range(1)
    resident = _options(s.resident_layers, room_for)
    saving = _options(s.keep_layers, room_for if devices == 1 else range(1))
    embeddings = _options(s.resident_embeddings, range(2) if known else range(1),
                          {"on": 1, "off": 0})
    r, sv, e = (a.ravel() for a in np.meshgrid(resident, saving, embeddings, indexing="ij"))
    grids = [_filled(cfg, r, sv, e, a, gpu, devices, host)
             for a in _attention_options(cfg, known, devices)]
    return {key: np.concatenate([g[key] for g in grids]) for key in grids[0]}


def _attention_options(cfg: Config, known: bool, devices: int) -> list[int]:
    """The counts of layers keeping their attention to search (before the saving layers,
    which are subtracted later): the pin, or, where rows are long enough and the attention
    can keep it on one GPU, every count."""
    s, layers = cfg.stream, cfg.model.layers
    count = pinned(s.keep_attention)
    if count is not None:
        return [count]
    if s.keep_attention == "on":
        return [layers]  # every layer that does not save: clipped per candidate
    long_rows = cfg.data.seq_len >= auto.KEEP_ATTENTION_FROM
    if s.keep_attention == "off" or not (known and long_rows and keeps_attention(cfg, devices)):
        return [0]
    return list(range(layers + 1))


def keeps_attention(cfg: Config, devices: int) -> bool:
    """Whether cfg's layers can keep their attention for the backward: the cuDNN or the
    blockwise attention, on one GPU."""
    path = memory.activations(cfg)["attention"]
    return devices == 1 and path in auto.KEEPS_ATTENTION


def _filled(cfg: Config, r, sv, e, attention: int, gpu, n: int, host_room) -> dict:
    """The candidates (r, sv, e) with `attention` layers keeping their attention: their saved
    inputs on the GPU as far as its room holds them (the fewest on the host that fit), the
    fewest recomputed inputs with which the host's room holds the rest (recompute.fewest), kept
    weights in the GPU's room left (the most that fit), and their bytes."""
    s, layers = cfg.stream, cfg.model.layers
    inputs, zero = layers - sv, np.zeros_like(r)
    a = np.minimum(attention, inputs)
    twice = np.maximum(0, layers - sv - r)  # the streamed layers fetched again
    budget = np.inf if gpu is None else gpu - HEADROOM
    count = pinned(s.recompute_inputs)
    recomputed = zero + (count or 0)

    def fits(host, weights):
        plan = PlacementPlan(r, e, sv, a, weights, host, recomputed)  # as far as chosen
        return sum(memory.device_bytes(cfg, plan, n).values()) <= budget

    pinned_weights = _pinned_weights(cfg, twice)
    weights = zero if pinned_weights is None else pinned_weights
    if s.saved_inputs == "pinned_host":
        host = inputs
    elif pinned(s.saved_inputs) is not None:
        host = np.minimum(pinned(s.saved_inputs), inputs)
    elif s.saved_inputs == "device" or gpu is None:
        host = zero
    else:  # the fewest on the host that fit (all of them where none does): the GPU's bytes
        host = least(lambda h: fits(h, weights), zero, inputs)  # fall as more wait there
    if s.recompute_inputs == "auto" and host_room is not None:
        plan = PlacementPlan(r, e, sv, a, weights, host)
        recomputed = recompute.fewest(lambda d: host_total(cfg, dataclasses.replace(
            plan, recomputed_inputs=d), n), recompute.plain_layers(cfg, plan) - 1, host_room)
        recomputed = np.where(fits(host, weights), recomputed, zero)  # where the GPU holds it
    if pinned_weights is None and gpu is not None:  # the most that fit: the bytes grow with them
        weights = most(lambda w: fits(host, w), zero, twice)
    plan = PlacementPlan(r, e, sv, a, weights, host, recomputed)
    return {**{key: getattr(plan, key) for key in _PLAN_KEYS},
            "device_total": sum(memory.device_bytes(cfg, plan, n).values()),
            "host_total": host_total(cfg, plan, n)}


def _pinned_weights(cfg: Config, twice):
    """stream.keep_weights as pinned (a count within the layers fetched twice, on, off), or
    None where the planner fills them."""
    value = cfg.stream.keep_weights
    if value.isdigit():
        return np.minimum(int(value), twice)
    if value in ("on", "off"):
        return twice if value == "on" else np.zeros_like(twice)
    return None


def _bounds(cfg: Config, grid: dict, rates: roofline.Rates, devices: int):
    """(bound of a step that clips, bound of one that does not, the host update's seconds) of
    every candidate, from one evaluation over the shares of the update a step may run during
    its backward (the first share, 0, is the step that clips)."""
    shares = roofline.speculate_shares(cfg) if rates.overlapped_update else roofline.SHARES[:1]
    terms = roofline.bound_of(cfg, grid, rates, devices, shares[:, None])
    clipping, speculating = terms["step_s"][0], terms["step_s"].min(axis=0)
    if not isinstance(grid, dict):
        clipping, speculating = float(clipping[0]), float(speculating[0])
    return clipping, speculating, terms["host_update_s"]


def _refusal(cfg: Config, grid: dict, gpu: int | None, host: int | None) -> str:
    """Why no placement fits, with the numbers."""
    m, budget = cfg.model, np.inf if gpu is None else gpu - HEADROOM
    on_gpu = grid["device_total"] <= budget
    size = f"{m.num_params / 1e9:.2f}B params"
    if not on_gpu.any():
        least = grid["device_total"].min() + HEADROOM
        return (f"The step of this model ({size}, {cfg.data.tokens_per_step:,} tokens) needs "
                f"at least {least / GiB:.1f} GiB of GPU memory with nothing resident, but the "
                f"GPU budget is {gpu / GiB:.1f} GiB: lower the tokens a micro-batch "
                "(data.micro_batches, data.seq_len), or raise stream.gpu_budget_gb.")
    # The placement that needs the least host memory (`closest`, whose table `plan` shows):
    # its resident layers, not the most any placement fitting the GPU could hold.
    k = _least_needing(np.where(on_gpu, grid["host_total"], np.inf), grid)
    least, held = grid["host_total"][k], grid["resident_layers"][k]
    compact = ", optim.state_dtype=bfloat16 or int8" if cfg.optim.name in HOST_OPTIMIZERS else ""
    return (f"The model needs {least / GiB:.1f} GiB of host memory ({size} in fp32 with "
            f"{cfg.optim.name} state; the GPU holds {held} of its {m.layers} layers' state "
            f"within its {(gpu or 0) / GiB:.1f} GiB budget) but only {host / GiB:.1f} GiB is "
            f"available{staging.refusal_note(cfg, least - host)}: use a smaller model{compact}, or "
            "a machine with more memory (`megatrain-jax plan` shows the largest shape that "
            "fits).")

