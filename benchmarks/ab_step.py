"""Settings of the speculative update (the host update during the backward) compared in one
process, in turns: each arm's steps meet the same host memory, whose bandwidth differs from
one process to the next by up to a fifth on the lent machines, so a pair of separate runs
cannot tell a few percent apart.

    python benchmarks/ab_step.py 7b --arm off=off --arm auto=auto --arm half=auto:0.5 \\
        --rounds 3 --steps 3 --warmup 4 [--repeat-batch] [key=value ...] [--out FILE]

An arm is NAME=SPECULATE[:SHARE[:KEPT]]: the engine's `stream.speculate` (off, auto, on),
`stream.speculate_share` (default 1) and how many layers keep the weights their forward
fetched for their backward (`stream.keep_weights` as a number; default: the config's, as
`train` settles it; the process's GPU peak is the largest arm's). After `--warmup` steps,
each round runs every arm for `--steps` steps, the arms' order rotating from round to round;
the first step of each block is not timed (the update it waits for was the last arm's).
Prints one JSON object: per arm the timed steps, their median and tokens/s, tokens/s over
the timed steps whose own update speculated (`tokens_per_s_speculating`: a step after one
that clipped does not), the parts speculated and undone; a table last.
`--out` is rewritten after every round, so a run cut short keeps its finished rounds.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, tokens_per_s  # noqa: E402

from megatrain_jax.config import load_config  # noqa: E402
from megatrain_jax.config.schema import layers_fetched_twice  # noqa: E402
from megatrain_jax.tools import plan  # noqa: E402  (no JAX yet: the pool is sized first)


def parse_arm(text: str) -> tuple[str, str, float, int | None]:
    name, _, setting = text.partition("=")
    speculate, _, rest = setting.partition(":")
    share, _, kept = rest.partition(":")
    try:
        share = float(share or 1.0)
    except ValueError:
        share = -1.0
    if not name or speculate not in ("off", "auto", "on") or not 0 < share <= 1 or \
            (kept and not kept.isdigit()):
        raise SystemExit(f"--arm {text!r}: expected NAME=SPECULATE[:SHARE[:KEPT]], e.g. "
                         "half=auto:0.5 or k3=auto:1:3")
    return name, speculate, share, int(kept) if kept else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--arm", action="append", type=parse_arm, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per arm and round")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeat-batch", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_intermixed_args()
    if args.steps < 2 or args.rounds < 1:
        raise SystemExit("--steps must be >= 2 (each block's first step is not timed) and "
                         "--rounds >= 1")

    cfg = plan.resolved(load_config(args.config, args.overrides))  # as `train` places it
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    plan.set_pool_env(cfg)

    import jax
    import numpy as np

    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.train import StreamTrainer
    from megatrain_jax.train.machine import host_rss_bytes, peak_device_bytes

    trainer = StreamTrainer(cfg)
    engine, data = trainer.engine, TokenSource(cfg)
    if engine.host_optimizer is None:
        raise SystemExit("the arms set the host update: use an optimizer with a host kernel")
    fetched_twice = layers_fetched_twice(cfg)
    for name, _, _, kept in args.arm:
        if kept is not None and kept > fetched_twice:
            raise SystemExit(f"--arm {name}: {kept} layers keeping their weights, of the "
                             f"{fetched_twice} fetched for their backward")
    state = trainer.init(jax.random.key(cfg.loop.seed))
    default_kept = engine.schedule.keep_weights
    arms = {name: {"speculate": s, "share": share,
                   "kept": default_kept if kept is None else kept, "step_s": [],
                   "speculating": [], "speculated": [], "undone": []}
            for name, s, share, kept in args.arm}
    step = 0

    def one_step(arm: dict | None) -> tuple[float, dict]:
        nonlocal state, step
        batch = data.batch_at(0 if args.repeat_batch else step)
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        loss = float(np.asarray(metrics["loss"]))
        seconds = time.perf_counter() - t0
        step += 1
        print(f"step {step} {arm and arm['name'] or 'warmup'}: {seconds:.3f} s, loss {loss:.4f}, "
              f"speculated {metrics.get('speculated_parts')}", file=sys.stderr, flush=True)
        return seconds, metrics

    for _ in range(args.warmup):
        one_step(None)
    names = list(arms)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            arm = arms[name]
            engine.speculate, engine.speculate_share = arm["speculate"], arm["share"]
            engine.schedule.keep_weights = arm["kept"]
            for k in range(args.steps):
                seconds, metrics = one_step({"name": name})
                if k:
                    arm["step_s"].append(seconds)
                    arm["speculating"].append(bool(metrics.get("speculating", 0.0)))  # its own
                    # the parts speculated in the update that overlapped this step: this arm's
                    arm["speculated"].append(int(metrics.get("speculated_parts", 0)))
                    arm["undone"].append(int(metrics.get("undone_parts", 0)))
        for arm in arms.values():
            arm["median_step_s"] = statistics.median(arm["step_s"])
            arm["tokens_per_s"] = tokens_per_s(cfg.data.tokens_per_step, arm["step_s"])
            arm["tokens_per_s_speculating"] = tokens_per_s(
                cfg.data.tokens_per_step,
                [t for t, g in zip(arm["step_s"], arm["speculating"]) if g])
        result = {"config": args.config, "overrides": args.overrides,
                  "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                  "cores": os.cpu_count(), "tokens_per_step": cfg.data.tokens_per_step,
                  "rounds": r + 1, "peak_device_gib": (peak_device_bytes() or 0) / 2**30,
                  "peak_host_rss_gib": host_rss_bytes() / 2**30, "arms": arms}
        if args.out and r + 1 < args.rounds:
            args.out.write_text(json.dumps(result) + "\n")
    emit(result, args.out)
    print(f"{'arm':10} {'speculate':9} {'share':>5} {'kept':>4} {'tok/s':>8} {'specul.':>8} "
          f"{'median s':>8}  steps (* speculating); parts speculated")
    for name, arm in arms.items():
        steps = " ".join(f"{s:.2f}{'*' if g else ''}" for s, g in zip(arm["step_s"],
                                                                       arm["speculating"]))
        speculating = arm["tokens_per_s_speculating"]
        print(f"{name:10} {arm['speculate']:9} {arm['share']:5.2f} {arm['kept']:4d} "
              f"{arm['tokens_per_s']:8,.0f} "
              f"{f'{speculating:,.0f}' if speculating else '-':>8} {arm['median_step_s']:8.3f}  "
              f"{steps}; {arm['speculated']}")


if __name__ == "__main__":
    main()
