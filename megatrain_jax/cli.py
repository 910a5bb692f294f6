"""`megatrain-jax`: train, plan and list configs from the command line.

    megatrain-jax train demo                          # the bundled demo, CPU or GPU
    megatrain-jax train configs/7b.json loop.steps=10 data.batch_size=16
    megatrain-jax plan 7b
    megatrain-jax report runs/latest                  # PNG plots, timeline, summary
    megatrain-jax export runs/latest out/             # a Hugging Face folder
    megatrain-jax prepare chat.jsonl --out data/chat --tokenizer Llama-3.1-8B/
    megatrain-jax sample runs/latest "Once upon a time"   # text from the latest checkpoint
    megatrain-jax configs

JAX is imported only after the config is read and checked, so that a bad key fails in a
moment and the pinned host pool can be sized from the model before the backend starts.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from megatrain_jax.config import (
    ConfigError,
    load_config,
    shipped_configs,
)
from megatrain_jax.io.checkpoint import CheckpointError
from megatrain_jax.tools import distributed, plan
from megatrain_jax.tools.plan_time import param_count

EPILOG = """\
CONFIG is a shipped config name (see `megatrain-jax configs`) or a .json/.gin file.
Overrides are section.key=value, e.g. model.layers=4 optim.lr=1e-4 loop.trainer=reference.
Sections: model, optim, schedule, data, stream, mesh, loop (docs/config.md lists every key).
"""


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)
    try:
        processes = distributed.settings(args.coordinator, args.processes, args.process_id)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if processes is not None:
        distributed.check_config(cfg)
    plan.check_fits(cfg)
    cfg = plan.resolved(cfg)  # the placement, decided once: the engine takes its numbers
    if cfg.loop.trainer == "stream":
        plan.set_pool_env(cfg, several_processes=processes is not None)
    if cfg.loop.deterministic:
        from megatrain_jax.train.deterministic import set_env

        set_env()  # read when JAX's backend starts
    if processes is not None:
        distributed.initialize(*processes)
        cfg = distributed.process_config(cfg)
    import jax

    from megatrain_jax.train import RunInterrupted, StopSignals, TrainingStopped, train
    from megatrain_jax.train.accounting import time_line
    from megatrain_jax.train.startup import kept

    def started(step: int) -> None:
        m = cfg.model
        print(f"megatrain-jax: {param_count(m.num_params)} params, {m.layers} layers, "
              f"{cfg.data.tokens_per_step:,} tokens/step, trainer={cfg.loop.trainer}, "
              f"device={jax.local_devices()[0].device_kind}, run_dir={cfg.loop.run_dir}"
              + (f", resuming at step {step}" if step else "")
              + (f"; placement: {plan.placement_summary(cfg)}"
                 if cfg.loop.trainer == "stream" else "")
              + f"; keeps {kept(cfg)}", file=sys.stderr)

    try:
        with StopSignals(cfg.loop.stop_save) as stop:
            summary = train(cfg, on_start=started, stop=stop)
    except TrainingStopped as e:
        print(f"megatrain-jax: {e}", file=sys.stderr)
        return 4
    except RunInterrupted as e:
        print(f"megatrain-jax: {e}", file=sys.stderr)
        return e.status
    if summary.pop("finished_before", False):
        if summary["checkpoint"] is not None:
            held = (f"its checkpoint {summary['steps']} is its last step (loop.steps="
                    f"{cfg.loop.steps}); nothing to do. To train on: {_train_on(args, cfg)}")
        else:
            held = (f"its records reach its last step (loop.steps={cfg.loop.steps}) and it kept "
                    "no checkpoint to go on from; nothing to do, nothing written")
        print(f"megatrain-jax: {cfg.loop.run_dir} is finished: {held}", file=sys.stderr)
    elif "time" in summary:
        print(f"megatrain-jax: {time_line(summary)}; kept {summary['kept']}", file=sys.stderr)
    summary.pop("state", None)
    print(json.dumps(summary))
    return 0


def _train_on(args, cfg) -> str:
    """The command that continues a finished run for as many steps again. Where the schedule
    decays until loop.steps, a longer run would change the rates of the steps already taken
    (which resume refuses), so the decay keeps its old length and the rate stays at its end."""
    steps = cfg.loop.steps
    new = [f"loop.steps={2 * steps}"]
    if cfg.schedule.decay_steps == 0 and cfg.schedule.kind != "constant":
        new.append(f"schedule.decay_steps={steps}")
    kept = [o for o in args.overrides if o.split("=", 1)[0] not in ("loop.steps",
                                                                     "schedule.decay_steps")]
    return shlex.join(["megatrain-jax", "train", args.config, *kept, *new])


def cmd_plan(args) -> int:
    from megatrain_jax.tools.plan_report import cmd_plan as plan_command

    return plan_command(args)


def cmd_export(args) -> int:
    from megatrain_jax.io.run_folder import run_config

    plan.set_pool_env(run_config(args.run_dir, args.step)[0])  # restored to the host
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


def cmd_sample(args) -> int:
    from megatrain_jax.train import sample  # starts JAX

    sample.check_settings(args.max_new_tokens, args.temperature, args.top_p)
    loaded = sample.load_model(args.source, args.step, args.dtype, args.tokenizer)
    ids = sample.prompt_ids(loaded, args.prompt, args.chat)
    how = "greedy" if args.temperature == 0 else \
        f"temperature {args.temperature}, top-p {args.top_p}, seed {args.seed}"
    print(f"megatrain-jax: sample: {loaded.source}, {len(ids)} prompt tokens, {how}",
          file=sys.stderr)
    shown = [""]

    def show(new_ids) -> None:  # text as it comes; an incomplete character waits
        text = loaded.tokenizer.decode(new_ids)
        if not text.endswith("\ufffd") and text.startswith(shown[0]):
            print(text[len(shown[0]):], end="", flush=True)
            shown[0] = text

    new, seconds = sample.timed(sample.generate, loaded, ids, args.max_new_tokens,
                                args.temperature, args.top_p, args.seed, show)
    text = loaded.tokenizer.decode(new)
    print(text[len(shown[0]):] if text.startswith(shown[0]) else "\n" + text)
    print(f"megatrain-jax: sample: {len(new)} tokens in {seconds:.1f} s, compiling included",
          file=sys.stderr)
    return 0


def cmd_configs(args) -> int:
    for name, path in shipped_configs().items():
        cfg = load_config(str(path))
        m = cfg.model
        print(f"{name:14s}{param_count(m.num_params):>8s}  layers={m.layers:<3d} "
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
    for name, fn, text, flags in (
        ("train", cmd_train, "train a model (the streaming engine unless loop.trainer=reference)",
         _train_flags),
        ("plan", cmd_plan, "show where a config's state and activations go on this machine "
         "(one GPU budget, stream.gpu_budget_gb, shared by the planner), the host and GPU "
         "memory it needs, the predicted step and what bounds it, and the largest shipped "
         "shape that fits host and GPU together. The placement keys stream.resident_layers, "
         "keep_layers, keep_attention, keep_weights, saved_inputs and resident_embeddings "
         "are advanced pins: set, each is kept and the planner places the rest around it",
         _plan_flags),
    ):
        p = sub.add_parser(name, help=text, description=text, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("config", help="shipped config name or path to a .json/.gin file")
        p.add_argument("overrides", nargs="*", help="section.key=value overrides")
        flags(p)
        p.set_defaults(fn=fn)
    _add_tools(sub)
    return parser


def _train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help="several processes (one per node): the first process's address and a "
                   "free port, the same for all (or JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--processes", type=int, default=None, metavar="N",
                   help="how many processes the run has (or JAX_NUM_PROCESSES; 0: detected "
                   "from SLURM or Open MPI)")
    p.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="this process's index, 0..N-1 (or JAX_PROCESS_ID)")


def _plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measure", action="store_true",
                   help="measure link, layer and optimizer rates on two layers of this model "
                   "(starts JAX; seconds to minutes) instead of the GPU's preset")
    p.add_argument("--rates", help="take the rates from a bench_step.py JSON instead")
    p.add_argument("--host-gb", type=float, default=None, metavar="N",
                   help="plan for a machine with N GiB of host memory instead of this one's; "
                   "with --host-gb or --gpu-gb the exit status is 0 when the run fits, 1 (and "
                   "the reason) when it does not")
    p.add_argument("--gpu-gb", type=float, default=None, metavar="M",
                   help="plan for a GPU with M GiB of memory instead of this one's")
    p.add_argument("--budgets", default=None, metavar="B1,B2,...",
                   help="also the placement and predicted tokens/s at each of these GPU "
                   "budgets in GiB (stream.gpu_budget_gb), e.g. 24,48,80,141")
    p.add_argument("--tokens", type=float, default=None, metavar="N",
                   help="also the time N tokens take at the planned speed (e.g. 1e9, 20e9), "
                   "for steps that clip and steps that do not")
    p.add_argument("--gpus", type=int, default=None, metavar="K",
                   help="plan for K GPUs of this kind on one host (as mesh.data=K)")


def _add_tools(sub) -> None:
    """The subcommands around training: report, prepare, export, configs."""
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
    _add_sample(sub)


def _add_sample(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a run's checkpoint or an HF folder",
                       description="Prints what the model writes after PROMPT: from the latest "
                       "checkpoint of a run folder (or --step) or from a Hugging Face folder, "
                       "on the GPU where there is one (the whole model in GPU memory), with a "
                       "KV cache. A chat model's template wraps the prompt as a user message.")
    p.add_argument("source", metavar="RUN_OR_HF_FOLDER",
                   help="a training run's folder (loop.run_dir) or a Hugging Face model folder")
    p.add_argument("prompt", help="the text to continue, or a chat model's user message")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default): greedy, the most likely token each time")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="with a temperature: draw from the fewest most likely tokens whose "
                   "probability reaches P")
    p.add_argument("--seed", type=int, default=0, help="the draws' seed")
    p.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                   help="apply the tokenizer's chat template (auto: where it has one)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json, its folder, or 'bytes' (default: the model folder's, "
                   "else the one the run's data was prepared with)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the weights' and matmuls' dtype (bfloat16: half the GPU memory)")
    p.set_defaults(fn=cmd_sample)


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
