"""Plots the loss curves of runs' metrics.jsonl files in one figure (e.g. Muon beside AdamW).

    python3 benchmarks/plot_curves.py OUT.png LABEL=RUN/metrics.jsonl [LABEL=FILE ...]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str]) -> None:
    out, runs = argv[0], [arg.split("=", 1) for arg in argv[1:]]
    figure, axes = plt.subplots(figsize=(7, 4))
    for label, path in runs:
        records = [json.loads(line) for line in open(path)]
        axes.plot([r["step"] for r in records], [r["loss"] for r in records], label=label)
    axes.set(xlabel="step", ylabel="training loss", yscale="log")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
