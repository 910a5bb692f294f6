"""What every benchmark script shares: one JSON object on stdout, and in a file if asked.
(The median time of a repeated call is `megatrain_jax.roofline.median_seconds`.)"""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result)
    if out:
        out.write_text(text + "\n")
    print(text)
