"""What every benchmark script shares: one JSON object on stdout, and in a file if asked, and
tokens/s from a run's step times. (The median time of a repeated call is
`megatrain_jax.roofline.median_seconds`.)"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result)
    if out:
        out.write_text(text + "\n")
    print(text)


def tokens_per_s(tokens_per_step: int, step_s: list[float]) -> float | None:
    """Tokens per second at the median of `step_s`; None where there is no step."""
    return tokens_per_step / statistics.median(step_s) if step_s else None
