#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the wheels the GPU machine lacks for the DeepSpeed peer
# (benchmarks/peers/deepspeed_offload.py). Run here, from any folder of the checkout:
#
#     bash benchmarks/peers/deepspeed_wheels.sh
#
# DeepSpeed is published as a source distribution only: it is built here into a pure-Python
# wheel with no compiled ops (DS_BUILD_OPS=0, against .venv's CPU torch); its CPU Adam op is
# JIT-compiled on the GPU machine at first use (g++ and ninja there). Beside it, the wheels of
# its requirements that the GPU machines' image lacks: hjson and pydantic with
# pydantic-core (cp312 manylinux x86_64), annotated-types and typing-inspection. Versions
# are pinned to ask no more than typing-extensions 4.12.2 of the image. Then, on the GPU
# machine, a call that carries .whl starts with
#
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit;
#
# benchmarks/suite.py replaces PYTHONPATH for its runs: there, also name /tmp/site in a .pth
#     python3 -c "import site; open(site.getsitepackages()[0] + '/tmp_site.pth', 'w').write('/tmp/site\n')"
set -euo pipefail

DEEPSPEED=${DEEPSPEED:-0.19.8}
PURE=(hjson==3.1.0 pydantic==2.11.10 annotated-types==0.7.0 typing-inspection==0.4.2)
BINARY=(pydantic-core==2.33.2)  # pydantic 2.11.10 pins it

cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
# shellcheck disable=SC1091
. .venv/bin/activate
mkdir -p .whl
# Two versions of one package stop the install there: drop ours, keep anything else.
rm -f .whl/deepspeed-*.whl .whl/hjson-*.whl .whl/pydantic-*.whl .whl/pydantic_core-*.whl \
    .whl/annotated_types-*.whl .whl/typing_inspection-*.whl

DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation \
    "deepspeed==$DEEPSPEED" -w .whl
ds=.whl/deepspeed-$DEEPSPEED-py3-none-any.whl
[ -f "$ds" ] || { echo "no $ds: the build gave $(ls .whl)" >&2; exit 1; }
if unzip -l "$ds" | grep -qE '\.(so|pyd)$'; then
    echo "$ds holds compiled code: not for the GPU machine" >&2; exit 1
fi

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "${PURE[@]}" "${BINARY[@]}"

# Every requirement of DeepSpeed's is either on the GPU image or here.
python - "$ds" <<'EOF'
import re
import sys
import zipfile
from pathlib import Path

there = {"einops", "msgpack", "ninja", "numpy", "packaging", "psutil", "py-cpuinfo", "torch",
         "tqdm", "nvidia-ml-py", "typing-extensions"}  # KINDS.md's list: on the image
here = {re.split(r"-\d", p.name)[0].replace("_", "-").lower() for p in Path(".whl").glob("*.whl")}
missing = []
for wheel in Path(".whl").glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                if "python_version < '3.9'" in line:
                    continue
                name = re.split(r"[ ;<>=!~\[(]", line.split(":", 1)[1].strip())[0].lower()
                name = name.replace("_", "-")
                if name not in there | here:
                    missing.append(f"{wheel.name}: {line}")
    if not (wheel.name.endswith("-py3-none-any.whl") or "-cp312-cp312-" in wheel.name):
        missing.append(f"{wheel.name}: not for CPython 3.12")
if missing:
    sys.exit("unmet:\n  " + "\n  ".join(missing))
EOF

ls -l .whl/*.whl | awk '{printf "%9d  %s\n", $5, $9; total += $5}
    END {printf "%9d  bytes in all (%.1f MiB)\n", total, total / 2^20}'
