"""Training quality of one setting's values: the same run from the same start with each value
of one key, its loss curves plotted and its final losses compared with the first value's.

    python benchmarks/quality.py demo --out benchmarks/results/DATE_cpu   # moments' dtypes
    python benchmarks/quality.py demo --name long loop.steps=600 model.layers=6
    python benchmarks/quality.py 1b --compare model.fp8_matmuls=false,true --name fp8 \
        loop.steps=300 data.source=bundled                                # FP8 against bf16

`--compare KEY=V1,V2,...` (default: optim.state_dtype=float32,bfloat16,int8). Writes
OUT/quality_NAME.json (every logged loss of each value, the final train loss as the mean of
the last `--tail` logged steps, the final validation loss) and OUT/quality_NAME.png (needs
matplotlib: pip install 'megatrain-jax[report]'), and prints a table. Each value trains in a
run folder of its own under OUT/runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMPARE = "optim.state_dtype=float32,bfloat16,int8"


def run(config: str, overrides: list[str], out: Path, name: str, compare: str) -> dict:
    from megatrain_jax.config import load_config
    from megatrain_jax.train import train

    key, values = compare.split("=", 1)
    results = {}
    for mode in values.split(","):
        run_dir = out / "runs" / f"{name}_{mode}"
        cfg = load_config(config, [*overrides, f"{key}={mode}", "loop.log_every=1",
                                   "loop.progress=none", "loop.tensorboard=off",
                                   f"loop.run_dir={run_dir}"])
        train(cfg)
        records = _lines(run_dir / "metrics.jsonl")
        evals = _lines(run_dir / "eval.jsonl") if (run_dir / "eval.jsonl").exists() else []
        results[mode] = {"steps": [r["step"] for r in records],
                         "loss": [r["loss"] for r in records],
                         "val": [(r["step"], r["loss"]) for r in evals]}
    return results


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(results: dict, tail: int) -> list[dict]:
    rows = []
    base = None
    for mode, r in results.items():
        final = sum(r["loss"][-tail:]) / len(r["loss"][-tail:])
        val = r["val"][-1][1] if r["val"] else None
        base = base or (final, val)
        rows.append({"mode": mode, "final_loss": final, "final_val_loss": val,
                     "vs_first": final / base[0] - 1,
                     "val_vs_first": (val / base[1] - 1) if val and base[1] else None})
    return rows


def plot(results: dict, path: Path, title: str, key: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, r in results.items():
        ax.plot(r["steps"], r["loss"], label=f"{key}={mode}", linewidth=1)
        if r["val"]:
            ax.plot(*zip(*r["val"]), "o--", markersize=3, linewidth=0.8,
                    color=ax.lines[-1].get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("loss (lines: train; dots: validation)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--name", default=None, help="the run's name (default: the config's)")
    parser.add_argument("--out", type=Path, default=Path("build/quality"))
    parser.add_argument("--tail", type=int, default=10, help="steps the final loss averages")
    parser.add_argument("--compare", default=COMPARE, help="KEY=V1,V2,...: the runs compared")
    args = parser.parse_intermixed_args()
    name = args.name or Path(args.config).stem
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args.config, args.overrides, args.out, name, args.compare)
    rows = summarize(results, args.tail)
    key = args.compare.split("=", 1)[0]
    record = {"config": args.config, "overrides": args.overrides, "compare": args.compare,
              "rows": rows, "curves": results}
    (args.out / f"quality_{name}.json").write_text(json.dumps(record, indent=1))
    try:
        plot(results, args.out / f"quality_{name}.png",
             f"{name}: {args.config} {' '.join(args.overrides)}", key)
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'megatrain-jax[report]')")
    print(f"| {key} | final train loss (last {args.tail}) | vs the first | final val loss "
          "| vs the first |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        val = f"{r['final_val_loss']:.4f}" if r["final_val_loss"] else "-"
        val_vs = f"{100 * r['val_vs_first']:+.2f}%" if r["val_vs_first"] is not None else "-"
        print(f"| {r['mode']} | {r['final_loss']:.4f} | {100 * r['vs_first']:+.2f}% | {val} "
              f"| {val_vs} |")


if __name__ == "__main__":
    main()
