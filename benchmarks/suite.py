"""One GPU session's benchmarks: named presets of runs, each a subprocess with a timeout.

    python benchmarks/suite.py speed                     # RESULTS.md's first table
    python benchmarks/suite.py standard --budget 570     # link rates, 3b and 7b at 16 x 1024
    python benchmarks/suite.py runs "3b:--steps 6 --warmup 2 --phases 2" \\
        "k32=7b:--steps 6 --warmup 2 --repeat-batch --phases 2 stream.resident_layers=32"
    python benchmarks/suite.py compare --tree old=build/old_tree --tree new=.
    python benchmarks/suite.py mesh --list               # what would run, and how

Each ITEM is a preset (PRESETS below: one per table of benchmarks/RESULTS.md, and tools) or
a run spec `[NAME=]CONFIG:ARGS` for bench_step.py. `--only`/`--skip` pick runs by name
(shell patterns). With `--tree [LABEL=]DIR` (repeatable), every bench_step run is made once per
tree, interleaved so that drift in the machine hits every tree alike, with DIR's own
bench_step.py and `PYTHONPATH=DIR`: rows are labelled by tree and their tokens/s compared.
Other runs (link rates, peers, the CLI) use this checkout. A preset may take longer than one
device call allows: `--budget` and `--only` keep a call within it.

Every run writes OUT_DIR/[TREE_]NAME.json and .log, and OUT_DIR/suite.json records its
command, exit code and seconds; a run past its timeout (or past `--budget`, the seconds left
to the whole invocation) is killed. After each run the table (summarize.py) is rewritten to
OUT_DIR/summary.txt and, where $OUT is set (the GPU machine's folder that comes back),
OUT_DIR is packed into $OUT/all.tgz with the table in $OUT/summary.txt: a session cut short
still brings back every finished run. The table is printed last. Several invocations with
the same `--out` add to one table.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from summarize import table

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    argv: tuple[str, ...]  # a script under the tree's root, or "-m" a module; then arguments
    timeout: int = 400
    per_tree: bool = False  # a bench_step run: once per --tree
    writes_json: bool = True  # takes `--out FILE` for its one JSON object


def cli(name: str, args: str, timeout: int = 300) -> Run:
    return Run(name, ("-m", "megatrain_jax.cli", *shlex.split(args)), timeout, writes_json=False)


def step(name: str, config: str, args: str, timeout: int = 400) -> Run:
    return Run(name, ("benchmarks/bench_step.py", config, *shlex.split(args)), timeout, True)


def peer(kind: str, shape: str, args: str = "", timeout: int = 400) -> Run:
    script = {"resident": "torch_resident.py", "fsdp2": "fsdp2_offload.py",
              "deepspeed": "deepspeed_offload.py"}[kind]
    return Run(f"peer_{kind}_{shape}", (f"benchmarks/peers/{script}", shape,
                                        *shlex.split(args)), timeout)


# The standard workload (benchmarks/README.md): 2 warm-up steps, the median of 6; 2 synced
# steps split the time. 7b trains on one repeated batch, so its loss must fall to ~0.
STANDARD = "--steps 6 --warmup 2 --phases 2"
# Steps that update during their backward: one repeated batch, whose first five steps clip,
# and a warm-up past them (benchmarks/RESULTS.md, "How these were measured").
SPECULATING = "--steps 6 --warmup 8 --repeat-batch --no-roofline"
CLI_RUN = "loop.checkpoint_every=2 loop.log_every=1 loop.run_dir={out}/run_1b"
TRANSFER = Run("transfer", ("benchmarks/bench_transfer.py", "--gib", "4"), 150)
LONG = "--steps 1 --warmup 1 --no-roofline data.batch_size=1"


def fsdp2(gpus: int) -> Run:
    """PyTorch FSDP2 with CPU offload on `gpus` ranks, 7b at 16 x 1024 tokens a rank."""
    return Run(f"peer_fsdp2_7b_{gpus}gpu", ("-m", "torch.distributed.run", "--standalone",
                                            f"--nproc_per_node={gpus}",
                                            "benchmarks/peers/fsdp2_offload.py", "7b",
                                            "--steps", "3", "--warmup", "1"), 420)


def long_run(name: str, tokens: int, extra: str = "") -> Run:
    return step(name, "7b", f"{LONG} data.seq_len={tokens} model.max_seq_len={tokens} {extra}",
                timeout=590)


# RESULTS.md's tables, one preset each: speed, capacity, long, mesh, bound (reliability has
# its soak). A preset may need more than one device call: --only picks runs.
PRESETS: dict[str, list[Run]] = {
    # Speed against peers, one GPU: 7b by the defaults and at under 16 GiB, 7b on random
    # tokens (every step clips), 3b; PyTorch resident at 7b, DeepSpeed ZeRO-3 offload at 3b
    # (its wheels carried: peers/deepspeed_wheels.sh; its CPU Adam compiles first, ~40 s).
    "speed": [step("7b_defaults", "7b", SPECULATING),
              step("7b_keep3", "7b", "--steps 4 --warmup 8 --repeat-batch --phases 2 "
                   "stream.keep_weights=3"),
              step("7b_clipping", "7b", "--steps 6 --warmup 2 --no-roofline "
                   "stream.keep_weights=3"),
              step("3b_defaults", "3b", SPECULATING),
              peer("resident", "7b", "--steps 6 --warmup 2"),
              peer("deepspeed", "3b", "--steps 6 --warmup 2", timeout=540)],
    # Memory and capacity: host bytes per parameter by gradient and moment dtype; 14b with
    # int8 moments; 30b needs a 503 GiB host (--only 30b on the four-GPU machine).
    "capacity": [step("7b_fp32_grads", "7b", "--steps 6 --warmup 2 --repeat-batch "
                      "--no-roofline stream.grad_dtype=float32"),
                 step("7b_bf16_moments", "7b", "--steps 3 --warmup 2 --no-roofline "
                      "optim.state_dtype=bfloat16"),
                 step("7b_int8", "7b", "--steps 3 --warmup 2 --no-roofline "
                      "optim.state_dtype=int8"),
                 step("14b_int8", "14b", "--steps 3 --warmup 1 --repeat-batch --no-roofline "
                      "optim.state_dtype=int8", timeout=500),
                 step("30b", "30b", "--steps 4 --warmup 3 --repeat-batch --no-roofline "
                      "mesh.data=1", timeout=590)],
    # Long context, batch 1: a step takes about 40 s at 131072 tokens and 3 minutes at
    # 262144; a whole 7b step at 524288 about 12 minutes, past a call's 10, so two layers of
    # its width stand in.
    "long": [long_run("7b_seq131072", 131072),
             long_run("7b_seq131072_recompute", 131072, "stream.keep_attention=off"),
             long_run("7b_seq262144", 262144),
             long_run("7b_2_layers_seq524288", 524288, "model.layers=2")],
    # Several GPUs: 7b at 16 x 1024 tokens a GPU on one, two and four; FSDP2 on four.
    "mesh": [step("7b_1gpu", "7b", f"{SPECULATING} mesh.data=1"),
             step("7b_2gpu", "7b", f"{SPECULATING} mesh.data=2 data.batch_size=32"),
             step("7b_4gpu", "7b", f"{SPECULATING} mesh.data=4 data.batch_size=64"),
             fsdp2(4)],
    # Scaling of the bound: the bound's terms measured in the process; tokens a step from 4k
    # to 64k on one initialized model (one synced step each); 64 x 1024 with the last 21
    # layers keeping their matmuls' outputs.
    "bound": [TRANSFER,
              step("7b_bound", "7b", "--steps 4 --warmup 8 --repeat-batch --phases 2 "
                   "stream.keep_weights=3"),
              step("7b_sweep", "7b", "--steps 3 --warmup 2 --phases 1 --sweep 4,8,16,32,64",
                   timeout=590),
              step("7b_64k_keep21", "7b", "--steps 3 --warmup 8 --repeat-batch --no-roofline "
                   "data.batch_size=64 data.micro_batches=4 stream.keep_layers=21",
                   timeout=500)],
    # Link rates, then 3b and 7b at 16 x 1024 with the bound: a quick look at a machine.
    "standard": [TRANSFER, step("3b_standard", "3b", STANDARD),
                 step("7b_standard", "7b", STANDARD + " --repeat-batch")],
    # Old tree against new on the standard shapes (no link rates: they do not depend on it).
    "compare": [step("3b_standard", "3b", STANDARD),
                step("7b_standard", "7b", STANDARD + " --repeat-batch")],
    # Where a step waits: the host update alone and beside the weight stream, and one
    # step's per-layer timeline (read it with benchmarks/timeline_summary.py).
    "probe": [Run("host_update", ("benchmarks/bench_host_update.py",), 240),
              *(step(f"{s}_timeline", s, f"--steps 4 --warmup 8 --repeat-batch --phases 1 "
                     f"--timeline {{out}}/{s}.timeline") for s in ("7b", "3b"))],
    # The command line on the GPU: train with checkpoints, resume, report.
    "cli": [cli("cli_train_1b", f"train 1b loop.steps=4 {CLI_RUN}"),
            cli("cli_resume_1b", f"train 1b loop.steps=6 {CLI_RUN}"),
            cli("cli_report_1b", "report {out}/run_1b", timeout=120)],
    # Checkpoints leave host memory flat: a 1,000-step 1b soak saved every 250 steps
    # (metrics.jsonl holds the memory of every 10th step), and 3b saved every 3 steps (int8
    # moments: two 3b checkpoints in fp32 moments, 75 GB, overflow the lent machine's 64 GB
    # disk). Two device calls: --only 'soak_1b*' (8 minutes on a slow host), --only ckpt_3b.
    "reliability": [cli("soak_1b", "train 1b data.batch_size=4 loop.steps=1000 "
                        "loop.checkpoint_every=250 loop.keep_checkpoints=1 loop.log_every=10 "
                        "loop.progress=plain loop.run_dir={out}/run_soak", timeout=575),
                    cli("soak_1b_report", "report {out}/run_soak", timeout=60),
                    cli("ckpt_3b", "train 3b optim.state_dtype=int8 loop.steps=9 "
                        "loop.checkpoint_every=3 loop.keep_checkpoints=1 loop.log_every=1 "
                        "loop.progress=plain loop.run_dir={out}/run_3b", timeout=300)],
    "runs": [],
    # The suite itself, on a CPU: tiny config, the resident peer on the CPU.
    "dev": [step("tiny", "tiny", "--steps 2 --warmup 1 --phases 1", timeout=300),
            peer("resident", "tiny", "--device cpu --batch 2 --seq 32 --steps 2 --warmup 1",
                 timeout=300)],
}


def parse_spec(spec: str) -> Run:
    """`[NAME=]CONFIG:ARGS` as a bench_step run; the name defaults to the words of both."""
    head, _, args = spec.partition(":")
    name, _, config = head.rpartition("=")
    if not name:
        words = [config, *(w.lstrip("-") for w in shlex.split(args))]
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", "_".join(words)).strip("-")
    return step(name, config, args)


def select(items: list[str], only: list[str], skip: list[str]) -> list[Run]:
    runs = []
    for item in items:
        if item in PRESETS:
            runs += PRESETS[item]
        elif ":" in item:
            runs.append(parse_spec(item))
        else:
            sys.exit(f"suite: '{item}' is neither a preset ({', '.join(PRESETS)}) nor a run "
                     "spec NAME=CONFIG:ARGS")

    def matches(run, patterns):
        return any(fnmatch.fnmatch(run.name, p) for p in patterns)

    return [r for r in runs if (not only or matches(r, only)) and not matches(r, skip)]


def parse_trees(values: list[str]) -> list[tuple[str, Path]]:
    trees = []
    for value in values:
        label, _, path = value.rpartition("=")
        path = Path(path).resolve()
        if not (path / "benchmarks" / "bench_step.py").exists():
            sys.exit(f"suite: {path} has no benchmarks/bench_step.py")
        trees.append((label or path.name, path))
    return trees or [("", ROOT)]


def _source_digest(tree: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted((tree / "megatrain_jax").rglob("*.py")):
        digest.update(str(path.relative_to(tree)).encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def machine(trees) -> dict:
    def sh(command):
        try:
            return subprocess.run(command, shell=True, capture_output=True, text=True,
                                  timeout=60).stdout.strip()
        except subprocess.TimeoutExpired:
            return "timed out"

    versions = sh(f"XLA_PYTHON_CLIENT_PREALLOCATE=false {sys.executable} -c "
                  "'import sys, jax; print(sys.version.split()[0], "
                  "\"jax\", jax.__version__, jax.devices()[0].device_kind)' 2>/dev/null")
    return {"gpu": sh("nvidia-smi --query-gpu=name,memory.total,driver_version "
                      "--format=csv,noheader 2>/dev/null"),
            "cpus": os.cpu_count(), "memory": sh("grep MemTotal /proc/meminfo"),
            "python_jax": versions, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "trees": describe(trees)}


def describe(trees) -> dict:
    """Each tree's path and a short hash of its package sources: which code a row measured."""
    return {label or "this": {"path": str(path), "sources": _source_digest(path)}
            for label, path in trees}


def execute(run: Run, tree: tuple[str, Path], out: Path, timeout: float,
            bench_args: list[str]) -> dict:
    label, path = tree if run.per_tree else ("", ROOT)
    stem = f"{label}_{run.name}" if label else run.name
    script = [] if run.argv[0] == "-m" else [str(path / run.argv[0])]
    args = [a.replace("{out}", str(out)) for a in run.argv[len(script):]]
    argv = [sys.executable, *script, *args, *(bench_args if run.per_tree else [])]
    argv += ["--out", str(out / f"{stem}.json")] if run.writes_json else []
    # The tree first; then what the caller had (carried wheels, e.g. a peer's DeepSpeed).
    paths = [str(path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1",
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    print(f"== {stem}: {shlex.join(argv[1:])}", flush=True)
    start = time.perf_counter()
    with open(out / f"{stem}.log", "w") as log:
        child = subprocess.Popen(argv, cwd=path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            rc = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = _stop(child)
            print(f"   killed after {timeout:.0f} s", file=log)
    seconds = time.perf_counter() - start
    if rc != 0:
        tail = [line for line in (out / f"{stem}.log").read_text().splitlines()
                if not line.startswith("W")][-25:]
        print(f"   FAILED (exit {rc}, {seconds:.0f} s):\n   " + "\n   ".join(tail), flush=True)
    return {"name": run.name, "tree": label, "rc": rc, "seconds": round(seconds, 1),
            "timeout": round(timeout), "json": f"{stem}.json" if run.writes_json else "",
            "log": f"{stem}.log",
            "command": shlex.join(["python", *argv[1:]]), "cwd": str(path),
            "pythonpath": str(path)}


def _stop(child: subprocess.Popen) -> int:
    """Ends a run and anything it started. SIGTERM first: torchrun starts its workers in
    sessions of their own and stops them on SIGTERM, where a SIGKILL would orphan them."""
    os.killpg(child.pid, signal.SIGTERM)
    try:
        rc = child.wait(timeout=15)
    except subprocess.TimeoutExpired:
        rc = None
    try:
        os.killpg(child.pid, signal.SIGKILL)  # whatever is left of the run's group
    except ProcessLookupError:
        pass
    return child.wait() if rc is None else rc


def publish(out: Path) -> str:
    """The table into OUT_DIR/summary.txt and, where $OUT is set, OUT_DIR into $OUT."""
    text = table(out)
    (out / "summary.txt").write_text(text + "\n")
    final = os.environ.get("OUT")
    if final:
        Path(final, "summary.txt").write_text(text + "\n")
        with tarfile.open(Path(final, "all.tgz"), "w:gz") as tar:
            tar.add(out, arcname=out.name, filter=_no_checkpoints)
    return text


def _no_checkpoints(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Leaves a run's checkpoints out of the archive (12 bytes per parameter)."""
    return None if "/checkpoints" in member.name else member


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="+", metavar="ITEM",
                        help=f"a preset ({', '.join(PRESETS)}) or NAME=CONFIG:ARGS")
    parser.add_argument("--out", type=Path,
                        default=Path("/tmp/megatrain_suite", time.strftime("%Y%m%d-%H%M%S")))
    parser.add_argument("--only", action="append", default=[], help="run names (patterns)")
    parser.add_argument("--skip", action="append", default=[], help="run names (patterns)")
    parser.add_argument("--tree", action="append", default=[], metavar="[LABEL=]DIR")
    parser.add_argument("--bench-args", default="", help="appended to every bench_step run")
    parser.add_argument("--budget", type=float, default=0,
                        help="seconds for all the runs (0: no limit)")
    parser.add_argument("--timeout", type=float, default=0,
                        help="seconds for each run instead of its own (0: its own)")
    parser.add_argument("--list", action="store_true", help="print the runs, run nothing")
    args = parser.parse_args()

    runs, trees = select(args.items, args.only, args.skip), parse_trees(args.tree)
    bench_args = shlex.split(args.bench_args)
    plan = [(run, tree) for run in runs for tree in (trees if run.per_tree else trees[:1])]
    if not plan:
        sys.exit("suite: no runs selected")
    if args.list:
        for run, tree in plan:
            where = f" [{tree[0]}: {tree[1]}]" if run.per_tree and tree[0] else ""
            print(f"{run.name}{where}: {shlex.join(run.argv)} (timeout {run.timeout} s)")
        return
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "suite.json"
    manifest = (json.loads(manifest_path.read_text()) if manifest_path.exists()
                else {"machine": machine(trees), "runs": []})
    manifest["machine"]["trees"].update(describe(trees))  # an added invocation's trees
    for run, tree in plan:
        run = dataclasses.replace(run, timeout=args.timeout or run.timeout)
        left = args.budget - (time.perf_counter() - start) - 20 if args.budget else run.timeout
        if left < 30:
            print(f"== {run.name}: skipped, {left:.0f} s of the budget left", flush=True)
            manifest["runs"].append({"name": run.name, "tree": tree[0] if run.per_tree else "",
                                     "rc": None, "json": "", "skipped": "budget"})
        else:
            manifest["runs"].append(execute(run, tree, args.out, min(run.timeout, left),
                                            bench_args))
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        publish(args.out)
    print(f"\nresults in {args.out}\n{publish(args.out)}")


if __name__ == "__main__":
    main()
