"""What every benchmark script shares: one JSON object on stdout, and in a file if asked, and
tokens/s from a run's step times. (The median time of a repeated call is
`megatrain_jax.tools.measure.median_seconds`.)"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result)
    if out:
        out.write_text(text + "\n")
    print(text)


def still_falling(step_s: list[float], by: float = 0.05) -> bool:
    """Whether timed steps were still getting faster: the later half's median more than `by`
    below the earlier half's (a fresh machine's memory, the first speculative updates). Their
    median then understates the settled rate, and the run wants a longer warm-up."""
    half = len(step_s) // 2
    if half < 2:
        return False
    return statistics.median(step_s[-half:]) < (1 - by) * statistics.median(step_s[:half])


def tokens_per_s(tokens_per_step: int, step_s: list[float]) -> float | None:
    """Tokens per second at the median of `step_s`; None where there is no step."""
    return tokens_per_step / statistics.median(step_s) if step_s else None
