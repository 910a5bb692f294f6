"""A progress bar for a terminal, plain log lines for everything else (CI, files, pipes).

    bar = Progress(total=100, mode="auto")
    bar.update(step, {"loss": 2.3, "tok/s": 5100})
    bar.close()
"""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _format(fields: dict) -> str:
    out = []
    for k, v in fields.items():
        if isinstance(v, float):
            v = f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        out.append(f"{k} {v}")
    return "  ".join(out)


class Progress:
    def __init__(self, total: int, mode: str = "auto", label: str = "train",
                 stream=None, plain_every: int = 1):
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "plain"
        self.mode = mode
        self.plain_every = max(plain_every, 1)
        self.start = time.perf_counter()
        self.first_done = None  # the first step includes compilation; ETA ignores it
        self.done = 0  # the last count shown

    def update(self, done: int, fields: dict) -> None:
        self.done = done
        if self.mode == "none":
            return
        now = time.perf_counter()
        if self.first_done is None:
            self.first_done = (done, now)
        d0, t0 = self.first_done
        rate = (done - d0) / (now - t0) if done > d0 and now > t0 else 0.0
        eta = (self.total - done) / rate if rate else 0.0
        line = f"{self.label} {done}/{self.total}  {_format(fields)}  eta {_clock(eta)}"
        if self.mode == "bar":
            width = 24
            filled = int(width * done / max(self.total, 1))
            bar = "█" * filled + "·" * (width - filled)
            self.stream.write(f"\r{bar} {line}\x1b[K")
            self.stream.flush()
        elif done % self.plain_every == 0 or done == self.total:
            self.stream.write(line + "\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (an eval result, say), above the bar on a terminal."""
        if self.mode == "none":
            return
        self.stream.write(("\r\x1b[K" if self.mode == "bar" else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()
