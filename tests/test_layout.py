"""The package's shape: one owner of memory kinds, small modules, layers that import downward."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatrain_jax"
# Lower layers never import higher ones; a step reads top to bottom in this order.
LAYERS = ["config", "model", "optim", "stream", "io", "planning", "train", "tools", "streaming",
          "cli"]


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_only_the_placement_names_memory_kinds():
    """A memory kind's name is spelled in stream/placement.py only. The option
    stream.saved_inputs takes "device" or "pinned_host" as values: lines about that option
    may name them (they are the config's words, which the placement interprets)."""
    kinds = re.compile(r"""["'](un)?pinned_host["']|memory_kind\s*=(?!=)""")
    offenders = []
    for path in _modules():
        if path == PACKAGE / "stream" / "placement.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if kinds.search(code) and "saved_inputs" not in code:
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_module_is_over_350_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > 350}
    assert not long, long


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "megatrain_jax" or len(parts) < 2:
        return None
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def _imports(path: Path) -> list[list[str]]:
    """For each import statement of `path`, the module names it may bring in."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append([node.module] + [f"{node.module}.{a.name}" for a in node.names])
        elif isinstance(node, ast.Import):
            found.append([a.name for a in node.names])
    return found


def _leaf(module: str) -> bool:
    """A module that imports nothing of the package (a utility any layer may use)."""
    path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return path.is_file() and not any(n.startswith("megatrain_jax")
                                      for names in _imports(path) for n in names)


def test_imports_go_downward_only():
    upward = []
    for path in _modules():
        relative = path.relative_to(PACKAGE).with_suffix("")
        own = _layer("megatrain_jax." + ".".join(relative.parts))
        if own is None:
            continue
        for names in _imports(path):
            if any(_leaf(n) for n in names):
                continue
            targets = [t for t in (_layer(n) for n in names) if t is not None]
            if targets and max(targets) > own:
                upward.append(f"{relative}: imports {names[0]}")
    assert not upward, "\n".join(upward)


def test_every_package_is_in_the_distribution():
    """pyproject.toml lists the packages a `pip install .` carries: a new one left out imports
    from the checkout but not from an install."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(PACKAGE.parent).parts)
             for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
