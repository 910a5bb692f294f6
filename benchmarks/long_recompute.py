"""7b at 524,288 tokens a step at fp32 on one H200 with recomputed inputs: the full-depth step
as the planner places it on this machine, and as many of its layers as one device call
allows, timed layer by layer (forward, backward, recomputed forward) against the plan.

    PYTHONPATH=. python benchmarks/long_recompute.py --layers 4 --out $OUT/long_recompute.json

A whole 32-layer step takes about 700 s, past one device call. The timed run keeps the
per-layer shape (7b's width, batch 1 x 524,288, cuDNN attention, tiled MLP) at `--layers N`
and the choices the full plan makes for its layers, pinned: half the layers resident, the
first half's inputs waiting on the host, and N/2 inputs recomputed in runs of two (the full
plan's longest run), so that it times a layer forward, a layer backward and a recomputed
forward as the full step runs them (a Timeline: per-bar seconds on the GPU, no stall). It
runs `--warmup` steps (the first compiles) and then timed steps while the call's time
allows (`--budget-s`), and prints a table last: measured against the preset's per-layer
rates, the N-layer step against its bound, and the full step extrapolated from the
measured layers against the full plan's bound and expectation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatrain_jax.config import load_config  # noqa: E402
from megatrain_jax.planning import presets, roofline  # noqa: E402
from megatrain_jax.planning.memory import device_bytes, plan_of  # noqa: E402
from megatrain_jax.tools import plan  # noqa: E402  (no JAX yet: the pool is sized first)

GiB = 2**30


def shape(config: str, seq_len: int, *more: str):
    return load_config(config, ["data.batch_size=1", f"data.seq_len={seq_len}",
                                f"model.max_seq_len={seq_len}", "data.source=random", *more])


def full_plan(config: str, seq_len: int, gpu: int | None = None,
              host: int | None = None) -> dict:
    """The whole step as `train` would place it on this machine (or within `gpu` usable and
    `host` bytes): placement, bytes, bound, expected seconds."""
    est = plan.estimate(shape(config, seq_len), gpu, host)
    if est["refused"]:
        return {"refused": est["refused"]}
    cfg = est["config"]
    rates = plan.machine_rates(cfg, 1)
    terms = roofline.bound_for(cfg, rates, 1)
    p = plan_of(cfg)
    return {"layers": cfg.model.layers, "placement": p.__dict__,
            "host_total_gib": est["host_total"] / GiB,
            "device_total_gib": est["device_total"] / GiB, "bound_s": terms["step_s"],
            "expected_s": presets.expected_seconds(terms, presets.MEASURED),
            "layer_forward_s": rates.layer_forward_s,
            "layer_backward_s": rates.layer_backward_s, "head_s": rates.head_s,
            "summary": plan.placement_summary(cfg)}


def run_config(config: str, seq_len: int, layers: int):
    """The N-layer config with the full plan's per-layer choices pinned (module docstring)."""
    half = layers // 2
    return shape(config, seq_len, f"model.layers={layers}", f"stream.resident_layers={half}",
                 "stream.resident_embeddings=on", "stream.keep_layers=0",
                 "stream.keep_attention=0", "stream.keep_weights=0",
                 f"stream.saved_inputs={half}", f"stream.recompute_inputs={half}")


def timed_steps(cfg, warmup: int, steps: int, budget_s: float, start: float) -> dict:
    """Steps of the N-layer run, each traced; the timed ones' bars by kind, and the peaks."""
    import jax
    import numpy as np

    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.stream import Timeline
    from megatrain_jax.train import make_trainer
    from megatrain_jax.train.machine import host_rss_bytes, peak_device_bytes

    trainer = make_trainer(cfg)
    state = trainer.init(jax.random.key(0))
    data, step_s, bars = TokenSource(cfg), [], {}
    for step in range(warmup + steps):
        elapsed = time.perf_counter() - start
        if step >= warmup and step_s and elapsed + 1.2 * step_s[-1] > budget_s:
            print(f"stopping at step {step}: {elapsed:.0f} s of {budget_s:.0f}", file=sys.stderr)
            break
        timeline, t0 = Timeline(), time.perf_counter()
        state, metrics = trainer.train_step(state, data.batch_at(step), tracer=timeline)
        loss = float(np.asarray(metrics["loss"]))
        state.wait()
        step_s.append(time.perf_counter() - t0)
        print(f"step {step + 1}: {step_s[-1]:.1f} s, loss {loss:.4f}, GPU peak "
              f"{(peak_device_bytes() or 0) / GiB:.2f} GiB", file=sys.stderr, flush=True)
        bars = _by_kind(timeline.finish())  # the last step's: warm where one was timed
    return {"step_s": step_s, "timed_steps": max(0, len(step_s) - warmup), "bars": bars,
            "gpu_peak_gib": (peak_device_bytes() or 0) / GiB,
            "host_rss_gib": host_rss_bytes() / GiB}


def _by_kind(bars: list[dict]) -> dict:
    """Seconds of the GPU's bars by kind: layer forward, backward, recomputed forward, head."""
    kinds = {"forward": [], "backward": [], "recompute": [], "head": []}
    for bar in bars:
        if bar["lane"] != "compute":
            continue
        kind = bar["name"].split()[0]
        if kind in kinds:
            kinds[kind].append(bar["end"] - bar["start"])
    return kinds


def report(full: dict, cfg, run: dict) -> dict:
    """The table's rows: measured against planned, and the full step extrapolated."""
    rates = plan.machine_rates(cfg, 1)
    terms = roofline.bound_for(cfg, rates, 1)
    bars = run["bars"]
    mean = {k: statistics.mean(v) if v else float("nan") for k, v in bars.items()}
    timed = run["step_s"][-run["timed_steps"]:] if run["timed_steps"] else run["step_s"][-1:]
    rows = {
        "layer forward": (mean["forward"], rates.layer_forward_s),
        "layer backward (recompute + VJP)": (mean["backward"], rates.layer_backward_s),
        "recomputed input (a forward)": (mean["recompute"], rates.layer_forward_s),
        "head + loss": (mean["head"], rates.head_s),
        f"{cfg.model.layers}-layer step": (statistics.median(timed), terms["step_s"]),
    }
    if "bound_s" in full:
        d, n = full["placement"]["recomputed_inputs"], full["layers"]
        layers = n * (mean["forward"] + mean["backward"]) + d * mean["recompute"]
        rows[f"{n}-layer step (extrapolated)"] = (layers + mean["head"], full["bound_s"])
    planned_gpu = sum(device_bytes(cfg, plan_of(cfg), 1).values()) / GiB
    rows["GPU GiB (peak / planned)"] = (run["gpu_peak_gib"], planned_gpu)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="7b")
    parser.add_argument("--seq-len", type=int, default=524288)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    full = full_plan(args.config, args.seq_len)  # this machine's, as `train` places it
    box = full_plan(args.config, args.seq_len, 133 * GiB, 125 * GiB)  # --host-gb 125 --gpu-gb 140
    for name, planned in (("this machine", full), ("host 125 GiB, GPU 140", box)):
        print(f"whole step planned ({name}):", json.dumps(planned), file=sys.stderr, flush=True)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    cfg = plan.resolved(run_config(args.config, args.seq_len, args.layers))
    plan.set_pool_env(cfg)
    run = timed_steps(cfg, args.warmup, args.steps, args.budget_s, start)
    rows = report(full, cfg, run)
    result = {"full_plan": full, "box_plan": box, "run_layers": args.layers, "run": run,
              "rows": {k: {"measured": m, "planned": p} for k, (m, p) in rows.items()},
              "run_placement": plan_of(cfg).__dict__}
    out = args.out or (Path(os.environ["OUT"]) / "long_recompute.json" if "OUT" in os.environ
                       else None)
    if out:
        out.write_text(json.dumps(result, default=float) + "\n")
    print(f"\n{'':34s}{'measured':>12s}{'planned':>12s}{'ratio':>10s}")
    for name, (measured, planned) in rows.items():
        ratio = measured / planned if planned else float("nan")
        print(f"{name:34s}{measured:12.2f}{planned:12.2f}{ratio:10.2f}")


if __name__ == "__main__":
    main()
