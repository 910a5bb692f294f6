"""Times training steps of a config and prints one JSON object (benchmarks/README.md).

    python benchmarks/bench_step.py 7b --steps 6 --warmup 2 [--repeat-batch] [key=value ...]
    python benchmarks/bench_step.py 7b --sweep 4,8,16,32,64     # batch sizes, one model

tokens/s is the median over the timed steps; each step is timed to the moment its loss is on
the host. `tokens_per_s_speculating` and `tokens_per_s_not_speculating` split the timed
steps by whether their own update was speculative, begun during their backward
(`stream.speculate`; a step after one that clipped does not speculate, and a note on stderr
says when some timed steps did not: with `--repeat-batch` the first steps clip, so give
`--warmup` enough of them). `--phases N` adds N steps that wait at the end of each phase
(forward, backward, update) to split the time; they update after the backward only (no
speculative update), and are reported apart and never mixed into tokens/s.
The roofline inputs (H2D and D2H bandwidth, one layer's forward and backward, the head, the
optimizer's rate, the host memory's bandwidth) are measured in the same process, after the
timed steps, and the JSON carries the bound and the ratio achieved / bound
(megatrain_jax/planning/roofline.py, tools/measure.py, docs/design.md). The optimizer's rate is
the model's own update in the `--phases` steps (median), else a 64M sample's.
With `--sweep`, the output is a JSON list, one object per batch size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, still_falling  # noqa: E402
from common import tokens_per_s as steps_tokens_per_s  # noqa: E402

from megatrain_jax.config import load_config, to_dict  # noqa: E402
from megatrain_jax.planning.memory import plan_of  # noqa: E402
from megatrain_jax.planning.presets import at_optimizer_rate, expected_seconds  # noqa: E402
from megatrain_jax.planning.roofline import (  # noqa: E402
    Rates,
    bound_for,
    bound_of,
    host_params,
    update_bytes,
)
from megatrain_jax.tools import plan  # noqa: E402  (no JAX yet: the pool is sized first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--phases", type=int, default=0)
    parser.add_argument("--repeat-batch", action="store_true",
                        help="train on one batch again and again (the loss must fall)")
    parser.add_argument("--sweep", type=str, default="",
                        help="comma-separated batch sizes to run on one initialized model")
    parser.add_argument("--no-roofline", action="store_true")
    parser.add_argument("--timeline", type=Path,
                        help="record one more (unsynced) step's timeline to this JSON file")
    parser.add_argument("--out", type=Path)
    args = parser.parse_intermixed_args()

    cfg = load_config(args.config, args.overrides)
    sizes = [int(b) for b in args.sweep.split(",") if b] or [cfg.data.batch_size]
    # It never saves: planned, and its pinned pool capped, as `train` does a run that does not
    # (a cap raised for a save's capture lets the pool's doubling regions grow past the plan).
    cfg = load_config(args.config, [*args.overrides, f"data.batch_size={max(sizes)}",
                                    "loop.final_checkpoint=false", "loop.stop_save=false",
                                    "loop.checkpoint_every=0"])
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    cfg = plan.resolved(cfg)  # the placement, as `megatrain-jax train` decides it
    plan.set_pool_env(cfg, measuring=not args.no_roofline)

    import jax

    from megatrain_jax.train import make_trainer
    from megatrain_jax.train.machine import host_rss_now_bytes

    jax.devices()  # the backend up: what the process holds before any state
    rss_start = host_rss_now_bytes()
    trainer = make_trainer(cfg)
    t0 = time.perf_counter()
    state = trainer.init(jax.random.key(cfg.loop.seed))
    jax.block_until_ready(state.wait().params)
    init_seconds = time.perf_counter() - t0
    results = []
    for size in sizes:
        run_cfg = load_config(args.config, [*args.overrides, f"data.batch_size={size}"])
        run_cfg = dataclasses.replace(trainer.cfg, data=run_cfg.data)  # placed as it runs
        state, result = run(run_cfg, trainer, state, args)
        result["init_s"] = init_seconds
        result["host_rss_start_gib"] = rss_start / 2**30
        results.append(result)
    emit(results if args.sweep else results[0], args.out)


def run(cfg, trainer, state, args):
    import jax
    import numpy as np

    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.stream.placement import memory_kinds
    from megatrain_jax.tools.measure import measure
    from megatrain_jax.train.machine import (
        host_rss_bytes,
        host_rss_parts_bytes,
        memory_gbps,
        peak_device_bytes,
        peak_flops,
    )

    data = TokenSource(cfg)

    def batch_at(step: int) -> dict:  # the one batch again and again with --repeat-batch
        return data.batch_at(0 if args.repeat_batch else step)

    times, losses, norms, speculated, speculating = [], [], [], [], []
    for step in range(args.warmup + args.steps):
        batch = batch_at(step)
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        loss = float(np.asarray(metrics["loss"]))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        gpu_peak = peak_device_bytes() or 0
        print(f"step {step + 1}/{args.warmup + args.steps}: {times[-1]:.3f} s, loss {loss:.4f}, "
              f"GPU peak {gpu_peak / 2**30:.2f} GiB, host peak "
              f"{host_rss_bytes() / 2**30:.2f} GiB",
              file=sys.stderr, flush=True)  # the log shows progress, even of a killed run
        norms.append(float(np.asarray(metrics["grad_norm"])))
        if "speculated_parts" in metrics:  # of the update that overlapped this step
            speculated.append((int(metrics["speculated_parts"]), int(metrics["undone_parts"])))
        speculating.append(bool(metrics.get("speculating", 0.0)))  # this step's own update

    phases = []
    engine = getattr(trainer, "engine", None)
    if engine is not None and args.timeline:
        from megatrain_jax.stream import Timeline

        timeline = Timeline()
        state, _ = trainer.train_step(state, batch_at(args.warmup + args.steps),
                                      tracer=timeline)
        state.wait()
        args.timeline.write_text(json.dumps({"layers": cfg.model.layers,
                                             "bars": timeline.finish()}) + "\n")
    if engine is not None and args.phases:
        from megatrain_jax.stream import PhaseTimer

        state.wait()  # else the first synced forward would also wait for the last update
        # The whole update after the backward: speculating would move part of it into the
        # backward, and the optimizer's rate taken from the rest would be too high.
        speculate, engine.speculate = engine.speculate, "off"
        for step in range(args.phases):
            timer = PhaseTimer()
            state, metrics = trainer.train_step(state, batch_at(step), tracer=timer)
            phases.append(dict(timer.seconds))
        engine.speculate = speculate

    timed, tokens = times[args.warmup:], cfg.data.tokens_per_step
    step_s = statistics.median(timed)
    if falling := still_falling(timed):
        print(f"the timed steps were still getting faster ({timed[0]:.3f} s to {timed[-1]:.3f}"
              " s): their median understates the settled rate; give --warmup more steps",
              file=sys.stderr)
    tokens_per_s = tokens / step_s
    # The timed steps split by whether their own update ran during the backward: a median
    # over both mixes two regimes (the first steps after clipping ones do not speculate).
    flags = speculating[args.warmup:]
    if getattr(engine, "speculate", "off") != "off" and not all(flags):
        which = ("none" if not any(flags) else f"only {flags.count(True)}") + \
            f" of the {len(flags)} timed steps"
        print(f"{which} updated during the backward (a step that clips, or follows one, does "
              "not speculate): " + ("the median mixes both, see tokens_per_s_speculating"
                                    if any(flags) else "they waited for their update") +
              "; give --warmup more steps for steps that speculate", file=sys.stderr)
    tokens_per_s_speculating = steps_tokens_per_s(tokens,
                                                  [t for t, g in zip(timed, flags) if g])
    tokens_per_s_not = steps_tokens_per_s(tokens, [t for t, g in zip(timed, flags) if not g])
    p = cfg.model.num_params
    model_flops = 6 * p * tokens_per_s
    peak = peak_flops(engine.placement.devices if engine is not None else 1)
    host_kinds = memory_kinds((state.params, state.opt_state)) if engine else set()
    rss = host_rss_bytes()
    rss_parts = host_rss_parts_bytes()  # now, after the timed steps, before any measuring
    # The state's own bytes in host memory (weights, optimizer state): the RSS beyond them
    # and the gradients is the runtime's overhead.
    state_bytes = sum(a.nbytes for a in jax.tree.leaves((state.params, state.opt_state))
                      if engine is not None and engine.placement.in_host_memory(a))
    roofline = {}
    if engine is not None and not args.no_roofline:
        # The optimizer's rate: this model's whole update timed alone in the synced steps
        # (median), else a 64M-parameter sample's. The bound at the better of the two rates
        # is reported beside it (`step_s_best_rate`), so a faster sample shows.
        # The host updates every part but the resident layers (updated on the GPU meanwhile).
        on_host = host_params(cfg)
        in_step = [on_host / ph["update"] / 1e9 for ph in phases]
        roofline = measure(cfg, engine, state, data.batch_at(0),
                           statistics.median(in_step) if in_step else 0.0)
        best = at_optimizer_rate(
            Rates.from_result(roofline),
            max(roofline["optimizer_gparams"], roofline["optimizer_sample_gparams"]),
            max(roofline["host_memory_kernel_gbps"], roofline["host_memory_shared_gbps"]),
            update_bytes(cfg))
        n = engine.placement.devices
        roofline["step_s_best_rate"] = bound_for(cfg, best, n)["step_s"]
        # The bound without the host memory's traffic, comparable with bounds that lack it.
        roofline["step_s_no_host_memory"] = bound_for(
            cfg, dataclasses.replace(Rates.from_result(roofline), host_memory_gbps=0.0),
            n)["step_s"]
        roofline["ratio_no_host_memory"] = step_s / roofline["step_s_no_host_memory"]
        roofline["ratio"] = step_s / roofline["step_s"]
        roofline["ratio_best_rate"] = step_s / roofline["step_s_best_rate"]
        roofline["ratio_to_ideal"] = step_s / roofline["ideal_s"]
        for phase in phases:  # the synced phases' time beyond compute: waits on transfers
            phase["forward_wait"] = max(phase["forward"] - roofline["compute_forward_s"], 0.0)
            phase["backward_wait"] = max(phase["backward"] - roofline["compute_backward_s"],
                                         0.0)
    # The host memory's speed, after the timed steps: the lent machines differ by up to 15%,
    # and a step that updates on the host follows it (benchmarks/RESULTS.md).
    host_gbps = roofline.get("host_memory_kernel_gbps") if roofline else (
        memory_gbps() if getattr(engine, "host_optimizer", None) else None)
    result = {
        "config": args.config, "overrides": args.overrides, "trainer": cfg.loop.trainer,
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "params": p, "tokens_per_step": cfg.data.tokens_per_step,
        "devices": engine.placement.devices if engine is not None else 1,
        "tokens_per_s": tokens_per_s, "median_step_s": step_s, "step_s": times,
        "timed_steps_falling": falling,
        "speculating": speculating, "tokens_per_s_speculating": tokens_per_s_speculating,
        "tokens_per_s_not_speculating": tokens_per_s_not,
        "model_tflops": model_flops / 1e12, "mfu": model_flops / peak if peak else None,
        "peak_device_gib": (peak_device_bytes() or 0) / 2**30,
        "peak_host_rss_gib": rss / 2**30, "host_bytes_per_param": rss / p,
        "host_state_gib": state_bytes / 2**30,
        # Resident memory by kind after the timed steps: pinned state and heap are `anon`,
        # the CUDA, cuDNN and XLA libraries' mapped code `file`.
        "host_rss_now_by_kind_gib": {k: v / 2**30 for k, v in rss_parts.items()},
        # Layers whose inputs waited on pinned host (stream.saved_inputs; auto's split).
        "saved_inputs_on_host": engine.placement.host_inputs if engine is not None else None,
        "layers_keeping_attention": engine.schedule.keep_attention if engine is not None else None,
        "layers_keeping_weights": engine.schedule.keep_weights if engine is not None else None,
        "resident_embeddings": engine.placement.resident_embeddings if engine else None,
        # The placement the planner chose (or the pins), and what it predicted at the rates
        # of this GPU's preset: a step that clips and one that does not.
        "placement": dataclasses.asdict(plan_of(cfg)) if engine is not None else None,
        "predicted": predicted(cfg) if engine is not None else None,
        "losses": losses, "grad_norms": norms,
        "speculated_parts": [s for s, _ in speculated], "undone_parts": [u for _, u in speculated],
        "update": "host" if getattr(engine, "host_optimizer", None) else "device",
        "host_kernel": getattr(getattr(engine, "host_optimizer", None), "kernel", None),
        "roofline": roofline,
        "host_state_memory_kinds": sorted(host_kinds),
        "phase_seconds_synced": phases,
        "pinned_pool_gb": os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"),
        "host_memory_gbps": host_gbps,
        "config_values": to_dict(cfg),
    }
    return state, result


def predicted(cfg) -> dict:
    """The planner's prediction of cfg's step at the rates of this machine's preset: its
    bounds, and the steps `plan` expects (presets.expected_seconds)."""
    rates, n, machine = plan.machine_rates(cfg), plan.planned_devices(cfg), plan.machine()
    clipping = bound_of(cfg, plan_of(cfg), rates, n)
    speculating = bound_for(cfg, rates, n)
    tokens = cfg.data.tokens_per_step
    return {"clipping_s": clipping["step_s"], "speculating_s": speculating["step_s"],
            "tokens_per_s_clipping": tokens / clipping["step_s"],
            "tokens_per_s_speculating": tokens / speculating["step_s"],
            "expected_tokens_per_s_clipping": tokens / expected_seconds(clipping, machine),
            "expected_tokens_per_s_speculating":
                tokens / expected_seconds(speculating, machine)}


if __name__ == "__main__":
    main()
