"""Plots a tokens-per-step sweep from bench_step.py --sweep: achieved tokens/s against the
roofline bound, with the step's cost split, so the point where it turns compute-bound shows.

    python benchmarks/plot_sweep.py results/SWEEP.json benchmarks/sweep_7b.png

Needs matplotlib (pip install 'megatrain-jax[report]').
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(source: Path, target: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(json.loads(source.read_text()), key=lambda r: r["tokens_per_step"])
    tokens = [r["tokens_per_step"] for r in runs]
    roof = [r["roofline"] for r in runs]
    fig, (speed, split) = plt.subplots(1, 2, figsize=(11, 4.2))
    speed.plot(tokens, [r["tokens_per_s"] for r in runs], "o-", label="achieved")
    speed.plot(tokens, [t / b["step_s"] for t, b in zip(tokens, roof)], "s--",
               label="bound of the exact schedule")
    speed.plot(tokens, [t / b["ideal_s"] for t, b in zip(tokens, roof)], ":", color="grey",
               label="perfect pipeline (docs/design.md)")
    for t, r, b in zip(tokens, runs, roof):
        speed.annotate(f"{r['tokens_per_s'] / (t / b['step_s']):.0%}", (t, r["tokens_per_s"]),
                       textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    speed.set(xscale="log", xlabel="tokens per step", ylabel="tokens/s",
              title=f"{runs[0]['config']} on {runs[0]['device']}: speed (% of bound)")
    speed.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    speed.set_xticks(tokens, [f"{t // 1024}k" for t in tokens])
    speed.legend(fontsize=8)
    speed.grid(alpha=0.3)

    parts = {"compute (fwd + head + bwd)": [b["compute_forward_s"] + b.get("compute_head_s", 0)
                                            + b["compute_backward_s"] for b in roof],
             "H2D (two weight passes)": [2 * b["h2d_per_pass_s"] for b in roof],
             "D2H (gradients)": [b["d2h_s"] for b in roof],
             "host optimizer": [b["optimizer_s"] for b in roof]}
    if any(b.get("host_memory_forward_s") for b in roof):  # absent from older results
        parts["host memory (update + DMA)"] = [b["host_memory_forward_s"]
                                              + b["host_memory_backward_s"] for b in roof]
    for name, seconds in parts.items():
        split.plot(tokens, seconds, "o-", label=name)
    split.plot(tokens, [r["median_step_s"] for r in runs], "k^-", label="achieved step")
    split.set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="seconds per step",
              title="cost of each resource per step")
    split.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    split.set_xticks(tokens, [f"{t // 1024}k" for t in tokens])
    split.legend(fontsize=8)
    split.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
