"""What `megatrain-jax plan` answers beyond "does it fit": how long N tokens take at the
planned speed (`--tokens`, `--gpus`), the batch from which the step is compute-bound, and
what one save costs the run.

    lines = time_lines(cfg, rates, tokens=20e9, gpus=8)    # cfg resolved, rates per GPU count
"""

from __future__ import annotations

from megatrain_jax.planning import memory, presets, roofline
from megatrain_jax.tools import plan


def param_count(n: int) -> str:
    """6.74B, 124.4M, 30.1K: a parameter count at a glance."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return str(n)


def duration(seconds: float) -> str:
    """42 s, 3.5 min, 7.2 h, 3.1 days: a time at a glance."""
    for least, scale, unit in ((2 * 86400, 86400, "days"), (3600, 3600, "h"), (60, 60, "min")):
        if seconds >= least:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.0f} s"


def expected_tokens_per_s(cfg, rates, devices: int) -> tuple[float, float]:
    """(tokens/s of steps that do not clip, of steps that clip) `plan` expects of a resolved
    cfg at `rates`: the bounds stretched as presets.expected_seconds says."""
    machine, tokens = plan.machine(), cfg.data.tokens_per_step
    no_clip = roofline.bound_for(cfg, rates, devices)
    clip = roofline.bound_of(cfg, memory.plan_of(cfg), rates, devices)
    return (tokens / presets.expected_seconds(no_clip, machine),
            tokens / presets.expected_seconds(clip, machine))


def time_lines(given, cfg, rates, goal: float | None, gpu, host) -> list[str]:
    """`plan`'s lines on speed and time: the time `goal` tokens take at the planned speed
    (None: no time), and the batch from which the step is compute-bound with what it would
    give there (placed anew, on GPUs of `gpu` usable bytes and a host of `host`)."""
    n, tokens, lines = plan.planned_devices(cfg), cfg.data.tokens_per_step, []
    where = f"{n} GPUs (mesh.data={n})" if n > 1 else "1 GPU"
    no_clip, clip = expected_tokens_per_s(cfg, rates, n)
    if goal:
        lines.append(f"{goal:,.0f} tokens on {where} at {tokens:,} tokens a step: "
                     f"{duration(goal / no_clip)} where steps do not clip ({no_clip:,.0f} "
                     f"tokens/s), {duration(goal / clip)} where every step clips "
                     f"({clip:,.0f} tokens/s)")
    p = memory.plan_of(cfg)
    compute_from = roofline.compute_bound_tokens(
        cfg.model, rates, tokens, p.resident_layers, p.resident_embeddings,
        p.unfetched(cfg.model.layers), p.saving_layers)
    if compute_from <= tokens:
        lines.append(f"compute-bound from about {compute_from:,} tokens a step (now "
                     f"{tokens:,}): this batch is, and a larger one gives no more tokens/s")
        return lines
    larger = _compute_bound_run(given, compute_from, n, gpu, host)
    if larger is None:
        lines.append(f"compute-bound from about {compute_from:,} tokens a step (now "
                     f"{tokens:,}): no batch that large fits here")
        return lines
    run, d = larger, larger.data
    fast, fast_clip = expected_tokens_per_s(run, presets.scaled(rates, d.tokens_per_step
                                                                / tokens), n)
    batch = f"data.batch_size={d.batch_size}" + (f" data.micro_batches={d.micro_batches}"
                                                   if d.micro_batches > 1 else "")
    lines.append(f"compute-bound from about {compute_from:,} tokens a step (now {tokens:,}): "
                 f"{batch} ({d.tokens_per_step:,} tokens) would give {fast:,.0f} tokens/s "
                 f"where steps do not clip, {fast_clip:,.0f} where they clip"
                 + (f"; {goal:,.0f} tokens in {duration(goal / fast)} and "
                    f"{duration(goal / fast_clip)}" if goal else ""))
    return lines


def _compute_bound_run(given, tokens: int, devices: int, gpu, host):
    """The given config at the batch of at least `tokens` a step (whole rows, a multiple of
    the GPUs), placed anew: in one micro-batch where that fits, else in micro-batches of
    the rows it has now; None where neither fits."""
    d = given.data
    rows = -(-tokens // d.seq_len)
    rows = -(-rows // devices) * devices
    per_micro = d.batch_size // d.micro_batches
    options = [1] + ([-(-rows // per_micro)] if rows > per_micro else [])
    for micro in options:
        total = rows if micro == 1 else micro * per_micro
        candidate = memory.replaced(given, "data", batch_size=total, micro_batches=micro)
        est = plan.estimate(candidate, gpu, host)
        if not est["refused"]:
            return est["config"]
    return None
