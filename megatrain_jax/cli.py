"""`megatrain-jax`: train, plan and list configs from the command line.

    megatrain-jax train demo                          # the bundled demo, CPU or GPU
    megatrain-jax train configs/7b.json loop.steps=10 data.batch_size=16
    megatrain-jax plan 7b
    megatrain-jax report runs/latest                  # PNG plots, timeline, summary
    megatrain-jax export runs/latest out/             # a Hugging Face folder
    megatrain-jax prepare chat.jsonl --out data/chat --tokenizer Llama-3.1-8B/
    megatrain-jax configs

JAX is imported only after the config is read and checked, so that a bad key fails in a
moment and the pinned host pool can be sized from the model before the backend starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatrain_jax.config import (
    ConfigError,
    load_config,
    memory,
    shipped_configs,
)
from megatrain_jax.config.memory_lines import describe, placement_lines
from megatrain_jax.io.checkpoint import CheckpointError
from megatrain_jax.tools import distributed, presets, roofline
from megatrain_jax.tools import plan as planner

EPILOG = """\
CONFIG is a shipped config name (see `megatrain-jax configs`) or a .json/.gin file.
Overrides are section.key=value, e.g. model.layers=4 optim.lr=1e-4 loop.trainer=reference.
Sections: model, optim, schedule, data, stream, mesh, loop (docs/config.md lists every key).
"""


GiB = 2**30


def _gib(n: float) -> str:
    return f"{n / 2**30:8.2f} GiB"


def _count(n: int) -> str:
    """6.74B, 124.4M, 30.1K: a parameter count at a glance."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return str(n)


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)
    try:
        processes = distributed.settings(args.coordinator, args.processes, args.process_id)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if processes is not None:
        distributed.check_config(cfg)
    planner.check_fits(cfg)
    cfg = planner.resolved(cfg)  # the placement, decided once: the engine takes its numbers
    if cfg.loop.trainer == "stream":
        planner.set_pool_env(cfg)
    if processes is not None:
        distributed.initialize(*processes)
        cfg = distributed.process_config(cfg)
    import jax

    from megatrain_jax.train import RunInterrupted, StopSignals, TrainingStopped, train

    def started(step: int) -> None:
        m = cfg.model
        print(f"megatrain-jax: {_count(m.num_params)} params, {m.layers} layers, "
              f"{cfg.data.tokens_per_step:,} tokens/step, trainer={cfg.loop.trainer}, "
              f"device={jax.local_devices()[0].device_kind}, run_dir={cfg.loop.run_dir}"
              + (f", resuming at step {step}" if step else ""), file=sys.stderr)
        if cfg.loop.trainer == "stream":
            print(f"megatrain-jax: placement: {planner.placement_summary(cfg)}",
                  file=sys.stderr)

    saves = cfg.loop.stop_save and cfg.loop.checkpoint_every > 0
    try:
        with StopSignals(saves) as stop:
            summary = train(cfg, on_start=started, stop=stop)
    except TrainingStopped as e:
        print(f"megatrain-jax: {e}", file=sys.stderr)
        return 4
    except RunInterrupted as e:
        print(f"megatrain-jax: {e}", file=sys.stderr)
        return e.status
    if summary.pop("finished_before", False):
        print(f"megatrain-jax: {cfg.loop.run_dir} is finished: its checkpoint {summary['steps']} "
              f"is its last step (loop.steps={cfg.loop.steps}); nothing to do. Raise loop.steps "
              "to train on.", file=sys.stderr)
    summary.pop("state", None)
    print(json.dumps(summary))
    return 0


def cmd_plan(args) -> int:
    given = load_config(args.config, args.overrides)
    host = planner.host_memory_available() if args.host_gb is None else int(args.host_gb * GiB)
    total_gpu = planner.gpu_memory_bytes() if args.gpu_gb is None else int(args.gpu_gb * GiB)
    gpu = planner.usable_gpu_bytes(total_gpu)
    rates, measured, source = _plan_rates(args, given)
    est = planner.estimate(given, gpu, host, rates)
    cfg = est["config"]  # placed: every placement key settled
    print(f"{cfg.model.num_params / 1e9:.2f}B parameters, {cfg.model.layers} layers, "
          f"{cfg.data.tokens_per_step:,} tokens per step, trainer={cfg.loop.trainer}")
    _print_memory(cfg, est, gpu, host)
    if cfg.loop.trainer == "stream":
        _print_placement(given, cfg, est, gpu, rates, source, measured)
    _print_fit(given, est, host, gpu, total_gpu, args)
    if args.budgets:
        _print_budgets(given, host, total_gpu, rates, args.budgets)
    if (args.host_gb is not None or args.gpu_gb is not None) and est["refused"]:
        print(f"megatrain-jax: plan: does not fit: {_plan_verdict(given, host, gpu)}",
              file=sys.stderr)
        return 1
    return 0


def _print_memory(cfg, est: dict, gpu: int | None, host: int | None) -> None:
    """`plan`'s host and device components, the pinned pool and the host bytes a parameter."""
    for where in ("host", "device"):
        print(f"{where}:" if where == "host" or est["devices"] == 1 else
              f"device (each of {est['devices']} GPUs, mesh.data):")
        for name, n in est[where].items():
            if n or name in ("master_weights", "saved_inputs"):
                print(f"  {name:22s}{_gib(n)}")
        print(f"  {'total':22s}{_gib(est[where + '_total'])}")
    if cfg.loop.trainer == "stream":
        cap = planner.pool_limit_gib(cfg, est["pool_state"])
        print(f"  pinned host pool      {_gib(planner.pinned_pool_bytes(cfg))}  (holds the host "
              f"state above; XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={cap} a GPU, set by `train`)")
        modes = planner.host_bytes_per_param(cfg, gpu, host)
        if len(modes) > 1:
            print("host bytes per parameter by optim.state_dtype (with these gradients and "
                  "the runtime): " + ", ".join(f"{k} {v:.1f}" for k, v in modes.items()))
    print("\n".join(describe(cfg, est["devices"]) + planner.traffic_lines(cfg)))


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
          f"{(rates.layer_forward_s + rates.layer_backward_s) * 1e3:.1f} ms")
    print(f"step bound: {b['step_s']:.3f} s ({tokens / b['step_s']:,.0f} tokens/s) where steps "
          f"do not clip, {clipping['step_s']:.3f} s ({tokens / clipping['step_s']:,.0f} "
          f"tokens/s) where they clip; the largest cost: "
          f"{clipping['limited_by'].replace('_', ' ')}")
    plan = memory.plan_of(cfg)
    compute_from = roofline.compute_bound_tokens(
        cfg.model, rates, tokens, plan.resident_layers, plan.resident_embeddings,
        plan.unfetched(cfg.model.layers), plan.saving_layers)
    print(f"compute-bound from about {compute_from:,} tokens per step (now {tokens:,})")
    expected = roofline.expected_step(b["step_s"], measured, tokens)
    if expected:
        print(expected)


def _print_fit(given, est: dict, host, gpu, total_gpu, args) -> None:
    """Whether the run fits, its checkpoints' disk, the largest shipped shape that fits."""
    target = args.host_gb is not None or args.gpu_gb is not None
    where = "the machine of --host-gb/--gpu-gb" if target else "this machine"
    for name, have, need in (("host", host, est["host_total"]),
                             ("GPU", gpu, est["device_total"])):
        if have is None:
            print(f"{name} memory: unknown here")
            continue
        verdict = "does NOT fit" if est["refused"] else "fits"
        usable = f" of {_gib(total_gpu).strip()} (XLA's share)" if name == "GPU" else ""
        print(f"{name} memory: {_gib(have).strip()}{usable}, {_gib(need).strip()} needed -> "
              f"{verdict}")
    disk = planner.checkpoint_disk(est["config"])
    if not given.loop.checkpoint_every:
        print(f"checkpoints: off (loop.checkpoint_every=0); each would take "
              f"{_gib(disk['each']).strip()}")
    else:
        verdict = "fits" if disk["needed"] <= disk["free"] else "does NOT fit"
        print(f"checkpoints: {_gib(disk['each']).strip()} each; loop.keep_checkpoints="
              f"{given.loop.keep_checkpoints} needs {_gib(disk['needed']).strip()} free in "
              f"{disk['folder']} (a new one is complete before the oldest goes): "
              f"{_gib(disk['free']).strip()} free -> {verdict}")
    best = planner.largest_fitting(given, host, gpu)
    if best is None:
        print(f"largest shipped shape that fits {where} (host and GPU together): none")
    else:
        name, fitting = best
        e = planner.estimate(fitting, gpu, host)
        print(f"largest shipped shape that fits {where} (host and GPU together): {name} "
              f"({fitting.model.num_params / 1e9:.2f}B params; host "
              f"{_gib(e['host_total']).strip()}, GPU {_gib(e['device_total']).strip()})")


def _print_budgets(given, host, total_gpu, rates, budgets: str) -> None:
    """The placement and predicted tokens/s at each GPU budget of `--budgets`."""
    print("by GPU budget (stream.gpu_budget_gb), at these rates:")
    print(f"  {'GiB':>6s}  {'resident':>8s}  {'saving':>6s}  {'kept w.':>7s}  "
          f"{'inputs on host':>14s}  {'tokens/s (no clip / clip)':>26s}")
    usable = planner.usable_gpu_bytes(total_gpu)
    for budget in _budget_list(budgets):
        cfg = memory.replaced(given, "stream", gpu_budget_gb=budget)
        est = planner.estimate(cfg, usable if usable is not None else int(budget * GiB), host,
                               rates)
        if est["refused"]:
            print(f"  {budget:6g}  does not fit")
            continue
        run, n = est["config"], est["devices"]
        plan, tokens = memory.plan_of(run), run.data.tokens_per_step
        guess = roofline.bound_for(run, rates, n)["step_s"]
        clip = roofline.bound_of(run, plan, rates, n)["step_s"]
        print(f"  {budget:6g}  {plan.resident_layers:8d}  {plan.saving_layers:6d}  "
              f"{plan.weight_layers:7d}  {plan.host_inputs:14d}  "
              f"{tokens / guess:>12,.0f} / {tokens / clip:<11,.0f}")


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
        planner.check_fits(cfg, host, gpu)
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
        rates = roofline.scaled(rates, cfg.data.tokens_per_step / measured_tokens)
        return rates, result, f"from {args.rates}"
    if not args.measure:
        machine = presets.preset_for(planner.gpu_name())
        return (machine.rates(cfg, planner.planned_devices(cfg)), None,
                f"preset {machine.name}, {machine.source}; --measure measures them here")
    planner.set_pool_env(cfg, measuring=True)
    from megatrain_jax.tools.measure import measure_rates  # starts JAX

    return measure_rates(cfg), None, "measured here"


def cmd_export(args) -> int:
    from megatrain_jax.io.run_folder import run_config

    planner.set_pool_env(run_config(args.run_dir, args.step)[0])  # restored to the host
    from megatrain_jax.train import export_run  # starts JAX

    out = export_run(args.run_dir, args.out_dir, args.step, args.dtype, args.progress,
                     note=lambda text: print(f"megatrain-jax: {text}", file=sys.stderr))
    print(f"wrote {out} (load it with transformers' AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_prepare(args) -> int:
    from megatrain_jax.io.prepare import prepare

    meta = prepare(args.inputs, args.out, args.tokenizer, args.progress, args.errors)
    print(f"wrote {args.out}: {meta['kind']} data, {meta['documents']:,} documents, "
          f"{meta['tokens']:,} tokens ({meta['trained_tokens']:,} trained on), vocabulary "
          f"{meta['vocab_size']:,}; train with data.source={args.out}")
    return 0


def cmd_configs(args) -> int:
    for name, path in shipped_configs().items():
        cfg = load_config(str(path))
        m = cfg.model
        print(f"{name:14s}{_count(m.num_params):>8s}  layers={m.layers:<3d} "
              f"hidden={m.hidden:<5d} vocab={m.vocab_size}")
    return 0


def cmd_report(args) -> int:
    from megatrain_jax.tools.report import ReportError, report

    try:
        written, lines = report(args.run_dir)
    except ReportError as e:
        print(f"megatrain-jax: report: {e}", file=sys.stderr)
        return 2
    print("\n".join([*lines, *(f"wrote {path}" for path in written)]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatrain-jax",
        description="Train large language models at full precision on one GPU, with every "
        "parameter and optimizer state in host memory and layers streamed through the GPU.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, text in (
        ("train", cmd_train, "train a model (the streaming engine unless loop.trainer=reference)"),
        ("plan", cmd_plan, "show where a config's state and activations go on this machine "
         "(one GPU budget, stream.gpu_budget_gb, shared by the planner), the host and GPU "
         "memory it needs, the predicted step and what bounds it, and the largest shipped "
         "shape that fits host and GPU together"),
    ):
        p = sub.add_parser(name, help=text, description=text, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("config", help="shipped config name or path to a .json/.gin file")
        p.add_argument("overrides", nargs="*", help="section.key=value overrides")
        if name == "train":
            p.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                           help="several processes (one per node): the first process's "
                           "address and a free port, the same for all (or "
                           "JAX_COORDINATOR_ADDRESS)")
            p.add_argument("--processes", type=int, default=None, metavar="N",
                           help="how many processes the run has (or JAX_NUM_PROCESSES; 0: "
                           "detected from SLURM or Open MPI)")
            p.add_argument("--process-id", type=int, default=None, metavar="I",
                           help="this process's index, 0..N-1 (or JAX_PROCESS_ID)")
        if name == "plan":
            p.add_argument("--measure", action="store_true",
                           help="measure link, layer and optimizer rates on two layers of this "
                           "model (starts JAX; seconds to minutes)")
            p.add_argument("--rates", help="take the rates from a bench_step.py JSON instead")
            p.add_argument("--host-gb", type=float, default=None, metavar="N",
                           help="plan for a machine with N GiB of host memory instead of this "
                           "one's; with --host-gb or --gpu-gb the exit status is 0 when the run "
                           "fits, 1 (and the reason) when it does not")
            p.add_argument("--gpu-gb", type=float, default=None, metavar="M",
                           help="plan for a GPU with M GiB of memory instead of this one's")
            p.add_argument("--budgets", default=None, metavar="B1,B2,...",
                           help="also the placement and predicted tokens/s at each of these "
                           "GPU budgets in GiB (stream.gpu_budget_gb), e.g. 24,48,80,141")
        p.set_defaults(fn=fn)
    p = sub.add_parser("report", help="plot a run's metrics and timeline (PNG) and summarize",
                       description="Writes loss.png, speed.png, memory.png and timeline.png "
                       "into RUN_DIR and prints a summary. Needs the `report` extra.")
    p.add_argument("run_dir", help="a training run's folder (loop.run_dir)")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("prepare", help="tokenize text files or JSONL into a data folder",
                       description="Tokenizes text files (one document each) or JSONL "
                       "({'text'}, {'prompt', 'response'} or {'messages'} per line) into "
                       "token memmaps for data.source=OUT.")
    p.add_argument("inputs", nargs="+", help="input files or glob patterns")
    p.add_argument("--out", required=True, help="a new folder to write")
    p.add_argument("--tokenizer", default="bytes",
                   help="'bytes' (ids 0..255), a tokenizer.json, or a folder holding one "
                   "(a Hugging Face model folder)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="bytes that are not UTF-8: 'strict' refuses the file naming the byte, "
                   "'replace' reads them as U+FFFD")
    p.add_argument("--progress", choices=("auto", "bar", "plain", "none"), default="auto")
    p.set_defaults(fn=cmd_prepare)
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face folder",
                       description="Writes checkpoint STEP (default: the latest) of RUN_DIR as "
                       "sharded safetensors + config.json that transformers loads; tokenizer "
                       "files of the checkpoint the run started from are copied along.")
    p.add_argument("run_dir", help="a training run's folder (loop.run_dir)")
    p.add_argument("out_dir", help="a new folder to write")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="tensor dtype (default: the source checkpoint's, else float32)")
    p.add_argument("--progress", choices=("auto", "bar", "plain", "none"), default="auto")
    p.set_defaults(fn=cmd_export)
    sub.add_parser("configs", help="list the shipped configs").set_defaults(fn=cmd_configs)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow the flags: `plan 7b --host-gb 125 optim.lr=1e-4`
    if extra and hasattr(args, "overrides") and all("=" in a and a[0] != "-" for a in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"megatrain-jax: config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"megatrain-jax: checkpoint error: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
