"""`megatrain-jax report RUN_DIR`: plots and a short summary of a training run.

Reads RUN_DIR/metrics.jsonl (and eval.jsonl, timeline.json when present) and writes PNGs
next to them:

    loss.png       train (and eval) loss over steps
    speed.png      tokens/s and MFU over steps
    memory.png     peak GPU memory and host RSS over steps
    timeline.png   one step, per layer: host->device copies, compute, device->host copies,
                   host optimizer, and the main thread's waits, as bars on a time axis

Needs matplotlib (`pip install 'megatrain-jax[report]'`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from megatrain_jax.stream.trace import LANES

LANE_COLORS = {"h2d": "#4C72B0", "compute": "#55A868", "d2h": "#8172B2",
               "host update": "#DD8452", "waits": "#C44E52"}


class ReportError(ValueError):
    """The run folder lacks what a report needs; the message says what and where."""


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file. A last line cut short, without its newline, is one a
    running `train` is writing: it is left out, not an error."""
    text = path.read_text()
    lines, records = text.splitlines(), []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                if n == len(lines) and not text.endswith("\n"):
                    break
                raise ReportError(f"{path}:{n} is not valid JSON ({e.msg})") from None
    return records


def time_line(summary: dict) -> str:
    """Where the last finished attempt's time went (train/accounting.py's split)."""
    from megatrain_jax.train.accounting import time_line as line

    return "last attempt's " + line(summary)


def summarize(metrics: list[dict], timeline: dict | None) -> list[str]:
    """A few lines: progress, speed, memory, where the step's time goes."""
    first, last = metrics[0], metrics[-1]
    steady = metrics[1:] or metrics  # the first record includes compilation
    lines = [
        f"steps {last['step']}, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
        f"skipped {last.get('skipped_steps', 0)}",
        f"tokens/s {statistics.median(r['tokens_per_s'] for r in steady):,.0f} (median)"
        + (f", MFU {statistics.median(r['mfu'] for r in steady):.1%}"
           if last.get("mfu") is not None else ""),
    ]
    gpu = [r["peak_device_bytes"] for r in metrics if r.get("peak_device_bytes") is not None]
    rss = max(r.get("host_rss_bytes", 0) for r in metrics)
    lines.append((f"peak GPU {max(gpu) / 2**30:.2f} GiB" if gpu else
                   "peak GPU: not reported (no GPU)") + f", host RSS {rss / 2**30:.2f} GiB")
    timed = [r for r in steady if "time_forward_backward_s" in r]
    if timed:
        split = {k[5:]: statistics.median(r.get(k, 0.0) for r in timed)
                 for k in ("time_forward_backward_s", "time_update_s", "time_wait_update_s",
                           "time_wait_d2h_s", "time_wait_compute_s", "time_wait_checkpoint_s")
                 if k in timed[-1]}
        lines.append("step split (median s): " + ", ".join(f"{k} {v:.3f}"
                                                          for k, v in split.items()))
    speculated = [r for r in metrics if r.get("speculated_parts")]
    if speculated:  # the host update during the backward (stream.speculate)
        lines.append(f"speculative update: {len(speculated)} of {len(metrics)} logged steps "
                     f"updated {sum(r['speculated_parts'] for r in speculated):.0f} parts "
                     f"early (during their backward), "
                     f"{sum(r.get('undone_parts', 0) for r in speculated):.0f} undone")
    if timeline:
        lines.append(timeline_verdict(timeline))
    return lines


def timeline_verdict(timeline: dict) -> str:
    """What the GPU's compute lane waits on in the recorded step."""
    bars = timeline["bars"]
    compute = [b for b in bars if b["lane"] == "compute"]
    if not compute:
        return "timeline: no compute recorded"
    span = max(b["end"] for b in bars) - min(b["start"] for b in bars)
    busy = sum(b["end"] - b["start"] for b in compute)
    waits = {}
    for b in bars:
        if b["lane"] == "waits":
            waits[b["name"]] = waits.get(b["name"], 0.0) + b["end"] - b["start"]
    cause = max(waits, key=waits.get) if waits else None
    text = (f"timeline of step {timeline['step']}: GPU compute busy {busy:.3f} s of "
            f"{span:.3f} s ({busy / span:.0%})")
    if cause:
        what = {"update": "the host optimizer", "d2h": "device->host copies",
                "checkpoint": "a checkpoint being written"}.get(cause, cause)
        text += f"; the main thread waited most on {what} ({waits[cause]:.3f} s)"
    return text


def _plot_series(plt, path: Path, title: str, series: dict, ylabel: str, right=None):
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, (xs, ys) in series.items():
        if xs:
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=name)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    if right:
        name, (xs, ys), label = right
        twin = ax.twinx()
        twin.plot(xs, ys, color="grey", linestyle="--", label=name)
        twin.set_ylabel(label)
        twin.legend(loc="lower right", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def label_positions(bars: list[dict], char: float) -> list[tuple[float, str]]:
    """(centre, name) of the bars of one lane to label: those whose name (`char` seconds a
    character) fits inside them, and never over a label already placed."""
    placed, free_from = [], -float("inf")
    for b in sorted(bars, key=lambda b: b["start"]):
        width, middle = (len(b["name"]) + 1) * char, (b["start"] + b["end"]) / 2
        if b["end"] - b["start"] > width and middle - width / 2 >= free_from:
            placed.append((middle, b["name"]))
            free_from = middle + width / 2
    return placed


def plot_timeline(plt, path: Path, timeline: dict) -> None:
    bars = timeline["bars"]
    lanes = [lane for lane in LANES if any(b["lane"] == lane for b in bars)]
    extent = max(b["end"] for b in bars) - min(b["start"] for b in bars)
    width = 12
    fig, ax = plt.subplots(figsize=(width, 0.6 * len(lanes) + 1.6))
    # A 6-point character is about 0.05 inch: in seconds, on an axis ~0.85 of the figure wide.
    char = 0.05 * extent / (0.85 * width)
    for row, lane in enumerate(lanes):
        spans = [(b["start"], b["end"] - b["start"]) for b in bars if b["lane"] == lane]
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=LANE_COLORS.get(lane, "grey"),
                       edgecolor="white", linewidth=0.3)
        for middle, name in label_positions([b for b in bars if b["lane"] == lane], char):
            ax.text(middle, row, name, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the step's start")
    ax.set_title(f"step {timeline['step']}: {timeline['layers']} layers, prefetch depth "
                 f"{timeline['prefetch_depth']}, {timeline['update']} optimizer")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(run_dir: str | Path) -> tuple[list[Path], list[str]]:
    """Writes the PNGs into run_dir; returns (written files, summary lines)."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        raise ReportError(f"{metrics_path} does not exist: is {run_dir} a run folder "
                          "(loop.run_dir of a training run)?")
    metrics = read_jsonl(metrics_path)
    if not metrics:
        raise ReportError(f"{metrics_path} has no records yet")
    eval_path, timeline_path = run_dir / "eval.jsonl", run_dir / "timeline.json"
    evals = read_jsonl(eval_path) if eval_path.exists() else []
    timeline = json.loads(timeline_path.read_text()) if timeline_path.exists() else None
    try:
        import matplotlib
    except ImportError:
        raise ReportError("report needs matplotlib: pip install 'megatrain-jax[report]'") \
            from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in metrics]

    def col(key, scale=1.0):
        pairs = [(r["step"], r[key] / scale) for r in metrics if r.get(key) is not None]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    written = []
    loss = {"train": (steps, [r["loss"] for r in metrics])}
    if evals:
        loss["eval"] = ([r["step"] for r in evals], [r["loss"] for r in evals])
    _plot_series(plt, run_dir / "loss.png", "loss", loss, "loss")
    written.append(run_dir / "loss.png")
    mfu = ("MFU", col("mfu"), "MFU") if any(r.get("mfu") for r in metrics) else None
    _plot_series(plt, run_dir / "speed.png", "speed", {"tokens/s": col("tokens_per_s")},
                 "tokens/s", right=mfu)
    written.append(run_dir / "speed.png")
    _plot_series(plt, run_dir / "memory.png", "memory",
                 {"peak GPU": col("peak_device_bytes", 2**30),
                  "GPU in use": col("device_bytes_now", 2**30),
                  "peak host RSS": col("host_rss_bytes", 2**30),
                  "host RSS": col("host_rss_now_bytes", 2**30)}, "GiB")
    written.append(run_dir / "memory.png")
    if timeline:
        plot_timeline(plt, run_dir / "timeline.png", timeline)
        written.append(run_dir / "timeline.png")
    lines = summarize(metrics, timeline)
    summary_path = run_dir / "summary.json"  # written by a finished attempt
    if summary_path.exists():
        lines.append(time_line(json.loads(summary_path.read_text())))
    return written, lines
