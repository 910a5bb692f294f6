"""What a checkpoint's manifest.json says of its arrays, and the parts of it that the processes
of one run write and the first merges.

    {"format": FORMAT, "step": 5, "meta": {...},        # the caller's record
     "arrays": [{"key": "['params']['embed'].table", "shape": [256, 32], "dtype": "float32",
                 "shards": [{"region": [[0, 128], [0, 32]], "file": "params.embed.table@0.0.bin",
                             "bytes": 16384, "checksum": "9f0c..."}, ...]}, ...]}

One process writes each array whole, as one shard. In a run of several processes each writes
the shards it holds (one copy of each) and lists them in STEP.partial/part-I.json; the first
merges the parts into the manifest once every process has written and verified its own, and
refuses, naming the array, a merge in which any element is missing or a file is not of the
size written. Format 1 (one whole file per array, written before shards) is read as one shard.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatrain_jax.io.shards import as_region, coverage_problem, whole

FORMAT = "megatrain-checkpoint/2"
READABLE = ("megatrain-checkpoint/1", FORMAT)
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, cannot be written or does not match the model."""


def complete_steps(directory: str | Path) -> list[int]:
    """Steps of the complete checkpoints in `directory` (folders STEP holding a manifest)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir()
                  if p.name.isdigit() and (p / MANIFEST).is_file())


class PartsDisagree(Exception):
    """The processes' parts do not make one whole checkpoint (the text says where)."""


def part_file(process: int) -> str:
    return f"part-{process}.json"


def shards_of(entry: dict) -> list[dict]:
    """An array's shards, from either format."""
    if "shards" in entry:
        return entry["shards"]
    return [{"region": [list(r) for r in whole(entry["shape"])], "file": entry["file"],
             "bytes": entry["bytes"], "checksum": entry["checksum"]}]


def manifest_bytes(step: int, meta: dict, arrays: list[dict]) -> bytes:
    return json.dumps({"format": FORMAT, "step": step, "meta": meta, "arrays": arrays},
                      indent=1).encode()


def merge_parts(folder: Path, processes: int) -> list[dict]:
    """The arrays of the parts in `folder` of every process, each array's shards together;
    checks that they tile every array and that every file has the size written."""
    merged: dict[str, dict] = {}
    for process in range(processes):
        path = folder / part_file(process)
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise PartsDisagree(f"{path} cannot be read ({e}); the run's folder must be on a "
                                "disk that every process sees") from None
        if merged and set(merged) != {a["key"] for a in part}:
            raise PartsDisagree(f"{path} lists other arrays than process 0's part")
        for array in part:
            known = merged.setdefault(array["key"], {**array, "shards": []})
            if (known["shape"], known["dtype"]) != (array["shape"], array["dtype"]):
                raise PartsDisagree(f"{array['key']} is {array['dtype']}{array['shape']} in "
                                    f"{path}, {known['dtype']}{known['shape']} in another part")
            known["shards"] += array["shards"]
    for array in merged.values():
        problem = coverage_problem(tuple(array["shape"]),
                                   [as_region(s["region"]) for s in array["shards"]])
        if problem:
            raise PartsDisagree(f"{array['key']}: {problem}")
        for shard in array["shards"]:
            file = folder / shard["file"]
            found = file.stat().st_size if file.is_file() else None
            if found != shard["bytes"]:
                what = "is missing" if found is None else \
                    f"holds {found} bytes, {shard['bytes']} written"
                raise PartsDisagree(f"{file} {what}; the run's folder must be on a disk that "
                                    "every process sees")
    return list(merged.values())
