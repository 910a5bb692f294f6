"""Prints the short table of one GPU session from the JSON files under a results folder.

    python benchmarks/summarize.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _runs(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return data if isinstance(data, list) else [data]


def main(out: Path) -> None:
    transfer = out / "transfer.json"
    if transfer.exists():
        r = json.loads(transfer.read_text())
        rates = r.get("host_update_gparams_per_s", {}).items()
        host = " ".join(f"{k} {v:.2f}" for k, v in rates if v)
        print(f"transfer: H2D {r['h2d_gbps']:.1f} GB/s  D2H {r['d2h_gbps']:.1f}  both "
              f"{r['bidirectional_total_gbps']:.1f}  update G params/s: device "
              f"{r['update_gparams_per_s']:.2f} host {host}")
    peers = {}
    for f in sorted(out.glob("peer_*.json")):
        r = json.loads(f.read_text())
        peers[r["shape"]] = r
        print(f"peer {r['peer']} {r['shape']}: {r['tokens_per_s']:.0f} tok/s, "
              f"{r['peak_device_gib']:.1f} GiB GPU, {r['host_bytes_per_param']:.1f} B/param host")
    print(f"{'run':30s} {'tok/s':>7s} {'step s':>6s} {'bound':>6s} {'ratio':>5s} {'best':>5s} "
          f"{'MFU':>5s} "
          f"{'GPU GiB':>7s} {'B/p':>5s} {'vs peer':>7s} {'hostGB/s':>8s} {'limit':>11s}"
          "  losses / phases")
    for f in sorted(out.glob("step_*.json")):
        for r in _runs(f):
            roof = r.get("roofline") or {}
            ph = r["phase_seconds_synced"][-1] if r["phase_seconds_synced"] else {}
            peer = peers.get(r["config"])
            vs = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else "-"
            name = f"{r['config']} {r['tokens_per_step'] // 1024}k {r.get('update', '')}"
            print(f"{name:30s} {r['tokens_per_s']:7.0f} {r['median_step_s']:6.2f} "
                  f"{roof.get('step_s', 0):6.2f} {roof.get('ratio', 0):5.2f} "
                  f"{roof.get('ratio_best_rate', 0):5.2f} "
                  f"{(r['mfu'] or 0):5.3f} {r['peak_device_gib']:7.2f} "
                  f"{r['host_bytes_per_param']:5.1f} {vs:>7s} "
                  f"{roof.get('host_memory_gbps', 0):8.0f} {roof.get('limited_by', '-'):>11s}  "
                  f"{r['losses'][0]:.2f}->{r['losses'][-1]:.2f} "
                  + " ".join(f"{k}={v:.2f}" for k, v in ph.items()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
