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


def test_imports_go_downward_only():
    """Every import of the package, a small utility's too, goes to its own layer or below: a
    utility that two layers share lives in the lower (the progress line in io, what the
    machine has in planning), so no layer leans on one above it."""
    upward = []
    for path in _modules():
        relative = path.relative_to(PACKAGE).with_suffix("")
        own = _layer("megatrain_jax." + ".".join(relative.parts))
        if own is None:
            continue
        for names in _imports(path):
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


def test_config_holds_what_users_write():
    """config/ is the schema, its loading, ranges and the Hugging Face mapping: the cost
    model and the decisions made from it live in planning/, and config/ reads none of it."""
    offenders = [f"{p.relative_to(PACKAGE)}: imports {names[0]}"
                 for p in sorted((PACKAGE / "config").glob("*.py")) for names in _imports(p)
                 if any(n.startswith("megatrain_jax.planning") for n in names)]
    assert not offenders, "\n".join(offenders)
    assert not [p.name for p in (PACKAGE / "config").glob("*.py")
                if p.stem in ("memory", "memory_lines", "optimizer_state")]


def _module_of(name: str) -> str | None:
    """The package's module `name` names (a module, or a package's __init__), else None."""
    if not name.startswith("megatrain_jax"):
        return None
    path = PACKAGE.parent.joinpath(*name.split("."))
    if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
        return name
    return None


def _import_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules its import statements name, at any depth
    (a function's own imports too): `from a import b` names a.b where b is a module, else a.
    The parents Python imports on the way (a's __init__ for a.b) are not counted."""
    graph = {}
    for path in _modules():
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        edges = set()
        for names in _imports(path):
            found = [m for m in map(_module_of, names[1:]) if m] or [_module_of(names[0])]
            edges.update(m for m in found if m and m != name)
        graph[name] = edges
    return graph


def test_no_import_cycle():
    """No module reaches itself through the modules it imports, and no layer does through
    the layers it imports (config's ranges and schema once imported each other)."""
    def cycle(graph):
        done, path = set(), []

        def visit(node):
            if node in path:
                return path[path.index(node):] + [node]
            if node in done:
                return None
            path.append(node)
            found = next((c for c in map(visit, sorted(graph.get(node, ()))) if c), None)
            path.pop()
            done.add(node)
            return found

        return next((c for c in map(visit, sorted(graph)) if c), None)

    modules = _import_graph()
    assert cycle(modules) is None, " -> ".join(cycle(modules))
    layers = {}
    for module, targets in modules.items():
        own = module.split(".")[1] if "." in module else module
        layers.setdefault(own, set()).update(
            t.split(".")[1] for t in targets if "." in t and t.split(".")[1] != own)
    assert cycle(layers) is None, " -> ".join(cycle(layers))
