"""Whole runs through the command line, as a user runs them, and where their time went: the
run's tokens/s and goodput with and without saves, each save's stall and background write,
the time from the command to the first step, and whether runs are equal bit for bit.

    python benchmarks/bench_goodput.py --dir RUNS --out FILE.jsonl RUN [RUN ...]

A RUN is NAME:CONFIG[,key=value...]; NAME up to a `~` names the run folder RUNS/NAME (a RUN of
the same folder resumes it: `a` then `a~again`). `--old PATH` runs a RUN whose name starts with
`old` from another checkout of the project. Prints a table last; each run's summary, notes and
losses go to FILE.jsonl, a line a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(name: str, spec: str, runs: Path, old: Path | None) -> dict:
    config, *overrides = spec.split(",")
    run_dir = runs / name.split("~")[0]
    checkout = old if name.startswith("old") and old else ROOT
    command = [sys.executable, "-m", "megatrain_jax.cli", "train", config,
               f"loop.run_dir={run_dir}", "loop.progress=plain", *overrides]
    env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONUNBUFFERED": "1"}
    began = time.perf_counter()
    first_step = None
    process = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    err_lines = []
    for line in process.stderr:
        err_lines.append(line)
        if first_step is None and line.startswith("megatrain-jax: ") and " params, " in line:
            first_step = time.perf_counter() - began  # the start line: the first step begins
    stdout = process.stdout.read()
    process.wait()
    wall = time.perf_counter() - began
    try:
        summary = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        summary = {}
    metrics = run_dir / "metrics.jsonl"
    losses = {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())} \
        if metrics.exists() else {}
    result = {"name": name, "spec": spec, "status": process.returncode, "wall_s": wall,
              "to_first_step_s": first_step, "summary": summary, "losses": losses,
              "notes": [line.strip() for line in err_lines if line.startswith("megatrain-jax")],
              "stderr_tail": "".join(err_lines[-30:])}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--dir", type=Path, required=True, help="the run folders")
    parser.add_argument("--out", type=Path, required=True, help="a JSON line a run")
    parser.add_argument("--old", type=Path)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for item in args.runs:
        name, spec = item.split(":", 1)
        result = run(name, spec, args.dir, args.old)
        with open(args.out, "a") as file:
            file.write(json.dumps(result) + "\n")
        s = result["summary"]
        t = s.get("time", {})
        rows.append((name, result["status"], s.get("tokens_per_s"), s.get("step_tokens_per_s"),
                     s.get("goodput"), result["to_first_step_s"], t.get("startup_s"),
                     s.get("save_stalls_s"), s.get("save_writes_s"), result["wall_s"]))
        print(json.dumps({k: v for k, v in result.items() if k != "losses"})[:3000], flush=True)
    print("\nrun | exit | run tok/s | steps tok/s | goodput | to 1st step s | startup s | "
          "save stalls s | save writes s | wall s")
    for row in rows:
        print(" | ".join(f"{x:,.1f}" if isinstance(x, float) else str(x) for x in row))


if __name__ == "__main__":
    main()
