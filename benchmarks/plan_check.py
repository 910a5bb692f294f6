"""The planner against the H200: the default speeds of 7b, 3b and 14b at 16 x 1024 tokens on
one repeated batch, and the planner's host total against each run's measured peak RSS.

    PYTHONPATH=. python benchmarks/plan_check.py            # about 6 minutes on one H200

Each run is bench_step.py in its own process (its own pinned pool), with the defaults (no
stream.* or optim.* key). bench_step does not save, so the host total compared leaves out
the save's staging area (`save_staging`, counted by `plan` for runs that save). Writes
$OUT/plan_check.json (each run's JSON, the planner's figures) and prints a table last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatrain_jax.config import Config, from_dict  # noqa: E402
from megatrain_jax.tools import plan  # noqa: E402  (no JAX here: each run is a process)

GiB = 2**30
# The floors of issue 55: defaults measured on one H200 (benchmarks/RESULTS.md, "Placement").
FLOORS = {"7b": 13673, "3b": 28514, "14b": 6120}
ARGS = ["--steps", "4", "--warmup", "8", "--repeat-batch", "--no-roofline"]


def run(shape: str, out: Path) -> dict:
    path = out / f"{shape}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), shape, *ARGS,
           "--out", str(path)]
    with open(out / f"{shape}.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              timeout=170).returncode
    return json.loads(path.read_text()) if code == 0 and path.exists() else {"exit": code}


def planned_host(result: dict) -> dict:
    """The planner's host bytes for the run's own resolved config, on this machine."""
    cfg = from_dict(Config, result["config_values"])
    est = plan.estimate(cfg)
    staging = est["host"].get("save_staging", 0)
    return {"host_total_gib": est["host_total"] / GiB, "save_staging_gib": staging / GiB,
            "host_without_staging_gib": (est["host_total"] - staging) / GiB,
            "components_gib": {k: v / GiB for k, v in est["host"].items()}}


def main() -> None:
    out = Path(os.environ.get("OUT", "plan_check_out"))
    out.mkdir(parents=True, exist_ok=True)
    rows, results = [], {}
    for shape in ("7b", "3b", "14b"):
        try:
            result = run(shape, out)
        except subprocess.TimeoutExpired:
            result = {"exit": "timeout"}
        if "tokens_per_s" in result:
            result["planned"] = planned_host(result)
        results[shape] = result
        (out / "plan_check.json").write_text(json.dumps(results, indent=1) + "\n")
        if "tokens_per_s" not in result:
            rows.append(f"{shape:4s} failed ({result.get('exit')}): see {shape}.log")
            continue
        planned = result["planned"]["host_without_staging_gib"]
        rss, tps = result["peak_host_rss_gib"], result["tokens_per_s"]
        rows.append(f"{shape:4s} {tps:9,.0f} {FLOORS[shape]:7,d} "
                    f"{'ok' if tps >= FLOORS[shape] else 'SLOWER':6s} {rss:8.1f} "
                    f"{planned:8.1f} {planned / rss - 1:+7.1%} "
                    f"{'ok' if abs(planned / rss - 1) <= 0.05 else 'OFF'}")
    print("shape tokens/s   floor  speed  RSS GiB plan GiB    diff  within 5%")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
