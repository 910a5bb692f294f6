import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install '.[test]'")
    folders = ["megatrain_jax", "tests", "benchmarks", "examples"]
    result = subprocess.run([ruff, "check", *folders], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# Code a maintainer reads in one sitting: no function in these places runs past this many
# lines (docstring included); a longer one is split into named phases.
MAX_FUNCTION_LINES = 60
SHORT_FUNCTION_PLACES = ["megatrain_jax/stream", "megatrain_jax/train", "megatrain_jax/cli.py"]


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`file:line name (N lines)` for every function or method in `path` over `limit`."""
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    where = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
                    found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_long_functions_are_found(tmp_path):
    source = tmp_path / "m.py"
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    source.write_text(f"def short():\n    pass\n\n\nclass A:\n    def long(self):\n{body}\n")
    flagged = long_functions(tmp_path, limit=60)
    assert len(flagged) == 1 and " long (61 lines)" in flagged[0]


def test_no_function_over_the_line_limit():
    flagged = [f for place in SHORT_FUNCTION_PLACES for f in long_functions(ROOT / place)]
    assert not flagged, (f"functions over {MAX_FUNCTION_LINES} lines; split each into named "
                         f"phases:\n" + "\n".join(flagged))
