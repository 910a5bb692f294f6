"""The short table of a benchmark folder: one row per step or peer run, link rates on top.

    python benchmarks/summarize.py DIR

Reads DIR/suite.json (written by suite.py: names, trees, exit codes, in run order) when it
exists, else every JSON file in DIR. Step rows (bench_step.py) show the roofline bound and
the ratio achieved / bound; peer rows (benchmarks/peers/) show the same speed and memory
columns. Runs of one name on several trees (suite.py --tree) are compared last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("tok/s", "step s", "bound", "ratio", "MFU", "GPU GiB", "host GiB", "B/p", "limit")


def load(folder: Path) -> list[dict]:
    """The folder's runs: {"name", "tree", "rc", "result"} per run, sweeps split per size."""
    manifest = folder / "suite.json"
    if manifest.exists():
        entries = json.loads(manifest.read_text())["runs"]
    else:
        entries = [{"name": f.stem, "tree": "", "rc": 0, "json": f.name}
                   for f in sorted(folder.glob("*.json"))]
    runs = []
    for entry in entries:
        path = folder / entry["json"]
        data = json.loads(path.read_text()) if entry["json"] and path.exists() else None
        if isinstance(data, list):  # a sweep: one result per batch size
            for r in data:
                runs.append({**entry, "name": f"{entry['name']}[{r['tokens_per_step'] // 1024}k]",
                             "base": entry["name"], "result": r})
        else:
            runs.append({**entry, "base": entry["name"], "result": data})
    return runs


def table(folder: Path) -> str:
    runs = load(folder)
    lines = _machine(folder)
    for run in runs:
        r = run["result"] or {}
        if "bidirectional_total_gbps" in r:
            host = r.get("host_update_gparams_per_s", {})
            lines.append(
                f"{run['name']}: H2D {r['h2d_gbps']:.1f} GB/s, D2H {r['d2h_gbps']:.1f}, both "
                f"{r['bidirectional_total_gbps']:.1f}; update G params/s: device "
                f"{r['update_gparams_per_s']:.2f}, host "
                + ", ".join(f"{k} {v:.2f}" for k, v in host.items() if v))
    rows = [run for run in runs if "bidirectional_total_gbps" not in (run["result"] or {})]
    width = max([len(_label(run)) for run in rows] + [3])
    lines.append(f"{'run':{width}s} " + " ".join(f"{c:>8s}" for c in COLUMNS)
                 + "  losses; last synced phases (s)")
    for run in rows:
        lines.append(f"{_label(run):{width}s} " + _row(run))
    lines += _tree_ratios(rows)
    return "\n".join(lines)


def _machine(folder: Path) -> list[str]:
    """The machine and the trees measured, as suite.py recorded them."""
    manifest = folder / "suite.json"
    if not manifest.exists():
        return []
    m = json.loads(manifest.read_text())["machine"]
    trees = ", ".join(f"{label} = {t['path']} (sources {t['sources']})"
                      for label, t in m["trees"].items())
    return [f"{m['started']}: {m['gpu'] or 'no GPU'}; {m['cpus']} CPUs, {m['memory']}; "
            f"{m['python_jax']}", f"trees: {trees}"]


def _label(run: dict) -> str:
    return f"{run['tree']}:{run['name']}" if run.get("tree") else run["name"]


def _row(run: dict) -> str:
    r = run["result"]
    if run.get("skipped"):
        return f"skipped ({run['skipped']})"
    if not run.get("json") and run.get("rc") == 0:
        return f"done ({run.get('seconds', 0):.0f} s; see {run['log']})"
    if r is None or "tokens_per_s" not in r:
        return f"FAILED (exit {run.get('rc')}; see {run.get('log', run['name'] + '.log')})"
    roof = r.get("roofline") or {}
    mfu = r.get("mfu")
    cells = [f"{r['tokens_per_s']:,.0f}", f"{r['median_step_s']:.3f}",
             f"{roof['step_s']:.3f}" if roof else "-", f"{roof['ratio']:.3f}" if roof else "-",
             f"{mfu:.3f}" if mfu else "-", _gib(r.get("peak_device_gib")),
             f"{r['peak_host_rss_gib']:.1f}", f"{r['host_bytes_per_param']:.1f}",
             roof.get("limited_by", "peer" if "peer" in r else "-")]
    losses = r.get("losses") or [float("nan")]
    phases = (r.get("phase_seconds_synced") or [{}])[-1]
    split = " ".join(f"{k} {v:.2f}" for k, v in phases.items() if not k.endswith("_wait"))
    host = (f"; host state {r['host_state_gib']:.1f} GiB, at start "
            f"{r['host_rss_start_gib']:.1f}" if "host_state_gib" in r else "")
    return (" ".join(f"{c:>8s}" for c in cells)
            + f"  {losses[0]:.2f}->{losses[-1]:.2f}" + (f"; {split}" if split else "") + host)


def _gib(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _tree_ratios(rows: list[dict]) -> list[str]:
    """tokens/s of each tree against the first tree, per run name and size."""
    by_name: dict[str, list[dict]] = {}
    for run in rows:
        if run.get("tree") and run["result"] and "tokens_per_s" in run["result"]:
            by_name.setdefault(run["name"], []).append(run)
    lines = []
    for name, group in by_name.items():
        if len(group) < 2:
            continue
        first = group[0]["result"]["tokens_per_s"]
        lines.append(f"{name}: " + ", ".join(
            f"{run['tree']} {run['result']['tokens_per_s']:,.0f}" for run in group)
            + " tok/s; " + ", ".join(
            f"{run['tree']}/{group[0]['tree']} {run['result']['tokens_per_s'] / first:.3f}"
            for run in group[1:]))
    return (["", "trees compared (tokens/s):"] + lines) if lines else []


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
