"""What every benchmark script shares: one JSON object on stdout, and in a file if asked."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result)
    if out:
        out.write_text(text + "\n")
    print(text)
