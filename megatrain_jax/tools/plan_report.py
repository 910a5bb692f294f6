"""What `megatrain-jax plan` prints: the host and GPU memory of a config's run, its placement
as a table of layers, the step's predicted bound and what bounds it, whether it fits, and the
placement and predicted tokens/s at other GPU budgets (`--budgets`).

    return cmd_plan(args)      # the CLI's `plan`, args as cli.build_parser() parses them
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.planning import memory, planner, pool, presets, roofline, staging
from megatrain_jax.planning.memory_lines import describe, placement_lines
from megatrain_jax.tools import plan
from megatrain_jax.tools.plan_time import param_count, time_lines

GiB = 2**30


def _gib(n: float) -> str:
    return f"{n / 2**30:8.2f} GiB"


def cmd_plan(args) -> int:
    for flag, value in (("--tokens", args.tokens), ("--gpus", args.gpus)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} {value:g}: expected a number above 0 (e.g. {flag} "
                              f"{'20e9' if flag == '--tokens' else '8'}).")
    gpus = [f"mesh.data={args.gpus}"] if args.gpus else []  # the plan for that many GPUs
    given = load_config(args.config, [*args.overrides, *gpus])
    host = plan.host_memory_available() if args.host_gb is None else int(args.host_gb * GiB)
    total_gpu = plan.gpu_memory_bytes() if args.gpu_gb is None else int(args.gpu_gb * GiB)
    gpu = plan.usable_gpu_bytes(total_gpu)
    rates, measured, source = _plan_rates(args, given)
    est = plan.estimate(given, gpu, host, rates)
    cfg = est["config"]  # placed: every placement key settled
    print(f"{param_count(cfg.model.num_params)} parameters, {cfg.model.layers} layers, "
          f"{cfg.data.tokens_per_step:,} tokens per step, trainer={cfg.loop.trainer}")
    _print_memory(given, cfg, est, gpu, host)
    if cfg.loop.trainer == "stream":
        _print_placement(given, cfg, est, gpu, rates, source, measured)
        print("\n".join(time_lines(given, cfg, rates, args.tokens, gpu, host)))
    _print_fit(given, est, host, gpu, total_gpu, args)
    if args.budgets:
        _print_budgets(given, host, total_gpu, rates, args.budgets)
    if (args.host_gb is not None or args.gpu_gb is not None) and est["refused"]:
        print(f"megatrain-jax: plan: does not fit: {_plan_verdict(given, host, gpu)}",
              file=sys.stderr)
        return 1
    return 0


def _print_memory(given, cfg, est: dict, gpu: int | None, host: int | None) -> None:
    """`plan`'s host and device components, the pinned pool and the host bytes a parameter."""
    for where in ("host", "device"):
        print(f"{where}:" if where == "host" or est["devices"] == 1 else
              f"device (each of {est['devices']} GPUs, mesh.data):")
        for name, n in est[where].items():
            if n or name in ("master_weights", "saved_inputs"):
                print(f"  {name:22s}{_gib(n)}")
        print(f"  {'total':22s}{_gib(est[where + '_total'])}")
    if cfg.loop.trainer == "stream":
        cap = plan.pool_limit_gib(cfg, pool.holds(cfg, est["pool_state"], est["devices"]))
        held = ("above (but the optimizer_state, in plain host memory)" if
                plan.host_update(cfg) else "above") + (
                    " and the save's staging" if est["host"]["save_staging"] else "")
        print(f"  pinned host pool      {_gib(est['devices'] * cap * GiB)}  (holds the host "
              f"state {held}; XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={cap} a GPU, set by `train`)")
        modes = plan.host_bytes_per_param(given, gpu, host)  # each placed anew
        if len(modes) > 1:
            print("host bytes per parameter by optim.state_dtype (with these gradients and "
                  "the runtime): " + ", ".join(f"{k} {v:.1f}" for k, v in modes.items()))
    print("\n".join(describe(cfg, est["devices"]) + plan.traffic_lines(cfg)))


def _print_placement(given, cfg, est: dict, gpu, rates, source: str, measured) -> None:
    """The placement table, the predicted step at these rates and what bounds it."""
    budget = planner.gpu_budget(given, gpu)
    room = "unknown: nothing placed on the GPU" if budget is None else \
        f"{budget / GiB:.1f} GiB a GPU (stream.gpu_budget_gb={given.stream.gpu_budget_gb:g})"
    print(f"placement (GPU budget {room}):")
    print("\n".join(placement_lines(cfg, given)))
    n = est["devices"]
    b = roofline.bound_for(cfg, rates, n)
    clipping = roofline.bound_of(cfg, memory.plan_of(cfg), rates, n)
    tokens = cfg.data.tokens_per_step
    print(f"rates ({source}): H2D {rates.h2d_gbps:.1f} GB/s, D2H {rates.d2h_gbps:.1f} GB/s, "
          f"optimizer {rates.optimizer_gparams:.2f} G params/s, host memory "
          f"{rates.host_memory_gbps:.0f} GB/s, layer forward+backward "
          f"{(rates.layer_forward_s + rates.layer_backward_s) * 1e3:.1f} ms"
          + (" with FP8 projections" if cfg.model.fp8_matmuls else ""))
    if b["newton_schulz_s"]:
        print(f"Newton–Schulz: {b['newton_schulz_s']:.3f} s a step on the GPU after the "
              "backward, every layer's matrices, resident or streamed (in the bound)")
    machine = plan.machine()
    print(f"step bound: {b['step_s']:.3f} s ({tokens / b['step_s']:,.0f} tokens/s) where steps "
          f"do not clip, {clipping['step_s']:.3f} s ({tokens / clipping['step_s']:,.0f} "
          f"tokens/s) where they clip; the largest cost: "
          f"{clipping['limited_by'].replace('_', ' ')}")
    kind = "an " + machine.name if "the figures are for" in source else "the machine kind"
    print(f"expected: {tokens / presets.expected_seconds(b, machine):,.0f} and "
          f"{tokens / presets.expected_seconds(clipping, machine):,.0f} tokens/s (the bound "
          f"times {machine.over_bound:g}, plus {machine.host_drag:.0%} of the host update's "
          f"seconds: what this engine takes on {kind})")
    expected = presets.expected_step(b["step_s"], measured, tokens)
    if expected:
        print(expected)
    print(staging.save_line(cfg, machine, presets.expected_seconds(b, machine)))


def _print_fit(given, est: dict, host, gpu, total_gpu, args) -> None:
    """Whether the run fits, its checkpoints' disk, the largest shipped shape that fits."""
    target = args.host_gb is not None or args.gpu_gb is not None
    where = "the machine of --host-gb/--gpu-gb" if target else "this machine"
    budget = planner.gpu_budget(given, gpu)
    # Each line its own verdict: the host's need against the host, the GPU's (with the room
    # the planner leaves free) against the GPU budget.
    for name, have, need, room in (("host", host, est["host_total"], host),
                                   ("GPU", gpu, est["device_total"],
                                    None if budget is None else budget - memory.HEADROOM)):
        if have is None:
            print(f"{name} memory: unknown here")
            continue
        verdict = "fits" if room is None or need <= room else "does NOT fit"
        usable = f" of {_gib(total_gpu).strip()} (XLA's share)" if name == "GPU" else ""
        print(f"{name} memory: {_gib(have).strip()}{usable}, {_gib(need).strip()} needed -> "
              f"{verdict}")
    disk = staging.checkpoint_disk(est["config"])
    if not staging.saves(given):
        print(f"checkpoints: none (no saves); each would take {_gib(disk['each']).strip()}")
    else:
        verdict = "fits" if disk["needed"] <= disk["free"] else "does NOT fit"
        print(f"checkpoints: {_gib(disk['each']).strip()} each; loop.keep_checkpoints="
              f"{given.loop.keep_checkpoints} needs {_gib(disk['needed']).strip()} free in "
              f"{disk['folder']} (a new one is complete before the oldest goes): "
              f"{_gib(disk['free']).strip()} free -> {verdict}")
    best = plan.largest_fitting(given, host, gpu)
    if best is None:
        print(f"largest shipped shape that fits {where} (host and GPU together): none")
    else:
        name, fitting = best
        e = plan.estimate(fitting, gpu, host)
        print(f"largest shipped shape that fits {where} (host and GPU together): {name} "
              f"({fitting.model.num_params / 1e9:.2f}B params; host "
              f"{_gib(e['host_total']).strip()}, GPU {_gib(e['device_total']).strip()})")


def _print_budgets(given, host, total_gpu, rates, budgets: str) -> None:
    """The placement and predicted tokens/s at each GPU budget of `--budgets`."""
    machine = plan.machine()
    print("by GPU budget (stream.gpu_budget_gb): the placement and the tokens/s expected at "
          "these rates (as above)")
    print(f"  {'GiB':>6s}  {'resident':>8s}  {'saving':>6s}  {'kept w.':>7s}  "
          f"{'inputs on host':>14s}  {'tokens/s (no clip / clip)':>26s}")
    usable = plan.usable_gpu_bytes(total_gpu)
    if host is not None:
        print(f"  (each on a host of {host / GiB:.1f} GiB and a GPU of "
              + ("each budget's size, as none is known here: --gpu-gb and --host-gb plan for "
                 "another machine)" if usable is None else f"{usable / GiB:.1f} GiB usable)"))
    for budget in _budget_list(budgets):
        cfg = memory.replaced(given, "stream", gpu_budget_gb=budget)
        gpu = usable if usable is not None else int(budget * GiB)
        est = plan.estimate(cfg, gpu, host, rates)
        if est["refused"]:
            print(f"  {budget:6g}  does not fit: {_short_reason(est, host, cfg, gpu)}")
            continue
        run, n = est["config"], est["devices"]
        placement, tokens = memory.plan_of(run), run.data.tokens_per_step
        no_clip = presets.expected_seconds(roofline.bound_for(run, rates, n), machine)
        clip = presets.expected_seconds(roofline.bound_of(run, placement, rates, n), machine)
        print(f"  {budget:6g}  {placement.resident_layers:8d}  {placement.saving_layers:6d}  "
              f"{placement.weight_layers:7d}  {placement.host_inputs:14d}  "
              f"{tokens / no_clip:>12,.0f} / {tokens / clip:<11,.0f}")


def _short_reason(est: dict, host, cfg, gpu) -> str:
    """Why a budget's row does not fit, in a few words: the host's or the GPU's bytes."""
    budget = planner.gpu_budget(cfg, gpu)
    if budget is not None and est["device_total"] > budget - memory.HEADROOM:
        return (f"its step needs {(est['device_total'] + memory.HEADROOM) / GiB:.1f} GiB of "
                "GPU memory")
    return f"the host needs {est['host_total'] / GiB:.1f} GiB of {(host or 0) / GiB:.1f}"


def _budget_list(text: str) -> list[float]:
    try:
        budgets = [float(b) for b in text.split(",") if b.strip()]
    except ValueError:
        budgets = []
    if not budgets or min(budgets) <= 0:
        raise ConfigError(f"--budgets {text}: expected GPU budgets in GiB, comma-separated "
                          "(e.g. 24,48,80,141).")
    return budgets


def _plan_verdict(cfg, host: int | None, gpu: int | None) -> str | None:
    """Why no placement fits `host` and `gpu` bytes (with the changes that would), or None."""
    try:
        plan.check_fits(cfg, host, gpu)
    except ConfigError as e:
        return str(e)
    return None


def _plan_rates(args, cfg):
    """(roofline rates at cfg's tokens per step, the measured run they come from or None, where
    they come from): a benchmark JSON, measured here, or the preset of this machine's GPU."""
    if args.rates:
        try:
            result = json.loads(Path(args.rates).read_text())
            rates = roofline.Rates.from_result(result["roofline"])
            measured_tokens = result["tokens_per_step"]
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"--rates {args.rates}: not a bench_step.py result ({e}).") from e
        shape = result.get("config_values", {}).get("model", {})
        width = ("hidden", "ffn", "heads", "kv_heads", "vocab_size")
        if shape and any(shape.get(k) != getattr(cfg.model, k) for k in width):
            raise ConfigError(
                f"--rates {args.rates} was measured on a model of another width "
                f"({', '.join(f'{k} {shape.get(k)}' for k in width)}); its layer times do "
                "not carry over: measure this width (any depth) with bench_step.py.")
        rates = presets.scaled(rates, cfg.data.tokens_per_step / measured_tokens)
        return rates, result, f"from {args.rates}"
    if not args.measure:
        machine = plan.machine()
        return (machine.rates(cfg, plan.planned_devices(cfg)), None,
                f"{plan.preset_label()} ({machine.source} figures); --measure measures this "
                "machine's")
    from megatrain_jax.tools.measure import measure_rates, measured_config

    plan.set_pool_env(measured_config(cfg), measuring=True)  # its two layers, streamed

    return measure_rates(cfg), None, "measured here"
