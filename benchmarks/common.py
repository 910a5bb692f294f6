"""What every benchmark script shares: one JSON object on stdout, and in a file if asked;
the median time of a repeated call."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def median_seconds(fn, repeats: int = 3) -> float:
    """Median wall time of `repeats` calls of fn, after one warm-up call (compilation)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result)
    if out:
        out.write_text(text + "\n")
    print(text)
