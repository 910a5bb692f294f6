"""Reads one step's timeline (bench_step.py --timeline) and says where the step's time went.

    python benchmarks/timeline_summary.py TIMELINE.json [STEP.json]

A compute bar runs from when its work was issued (or the previous compute ended) to when it
completed, so a bar longer than the layer's measured time waited for its inputs (weights
still in flight); a gap between bars is time the GPU had nothing issued. With the step's
JSON, per-layer times are set beside the roofline's measured ones.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _stats(bars: list[dict]) -> str:
    if not bars:
        return "-"
    d = [b["end"] - b["start"] for b in bars]
    return f"n={len(d)} median {1e3 * statistics.median(d):.1f} ms, sum {sum(d):.3f} s"


def summarize(timeline: dict, step: dict | None = None) -> dict:
    bars = timeline["bars"]
    lane = lambda name: [b for b in bars if b["lane"] == name]  # noqa: E731
    compute = lane("compute")
    forward = [b for b in compute if b["name"].startswith("forward ")]
    backward = [b for b in compute if b["name"].startswith("backward ")]
    head = next(b for b in compute if b["name"] == "head")
    end = max(b["end"] for b in compute)
    last_update = [b for b in lane("host update") if "last step" in b["name"]]
    this_update = [b for b in lane("host update") if "last step" not in b["name"]]
    gaps = {"forward": 0.0, "backward": 0.0}
    for a, b in zip(compute, compute[1:]):
        gap = b["start"] - a["end"]
        if gap > 0:
            gaps["forward" if b["start"] <= head["end"] else "backward"] += gap
    waits: dict[str, float] = {}
    for b in lane("waits"):
        waits[b["name"]] = waits.get(b["name"], 0.0) + b["end"] - b["start"]
    h2d_backward = [b for b in lane("h2d") if b["start"] >= head["end"]]
    out = {
        "step_end_s": end,
        "head_end_s": head["end"],
        "backward_s": end - head["end"],
        "last_update_start_s": min((b["start"] for b in last_update), default=None),
        "last_update_end_s": max((b["end"] for b in last_update), default=None),
        "tail_after_update_s": (head["end"] - max(b["end"] for b in last_update)
                                if last_update else None),
        "compute_gaps_s": gaps,
        "waits_s": waits,
        "forward_bars": _stats(forward),
        "backward_bars": _stats(backward),
        "backward_h2d_bars": _stats(h2d_backward),
        "d2h_bars": _stats(lane("d2h")),
        "this_update_s": (max(b["end"] for b in this_update) - min(b["start"] for b in this_update)
                          if this_update else None),
    }
    if step and step.get("roofline"):
        roof = step["roofline"]
        out["measured_layer_ms"] = {"forward": 1e3 * roof["layer_forward_s"],
                                    "backward": 1e3 * roof["layer_backward_s"],
                                    "head": 1e3 * roof["head_s"]}
        out["bound_s"], out["achieved_s"] = roof["step_s"], step["median_step_s"]
    return out


def main(path: Path, step_path: Path | None = None) -> None:
    step = json.loads(step_path.read_text()) if step_path and step_path.exists() else None
    for key, value in summarize(json.loads(path.read_text()), step).items():
        if isinstance(value, float):
            value = round(value, 4)
        elif isinstance(value, dict):
            value = {k: round(v, 4) for k, v in value.items()}
        print(f"  {key}: {value}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
