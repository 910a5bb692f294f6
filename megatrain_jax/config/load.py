"""Reading configs: JSON or gin files, shipped names, `a.b=c` overrides, run folders.

    cfg = load_config("configs/demo.json", ["model.layers=4", "loop.steps=50"])

Every value is checked against the field's type and allowed choices before anything is
allocated; an unknown key names the valid keys. A config whose model.hf_path names a Hugging
Face folder takes its architecture from that folder's config.json.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from pathlib import Path
from typing import Any

from megatrain_jax.config.schema import CHOICES, COUNTS, Config, ConfigError, validate


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of dataclass `cls` as section.key (section.sub.key when nested)."""
    keys = []
    for f in dataclasses.fields(cls):
        typ = typing.get_type_hints(cls)[f.name]
        keys += _dotted_keys(typ, f"{prefix}{f.name}.") if dataclasses.is_dataclass(typ) \
            else [prefix + f.name]
    return keys


def _suggest(name: str, valid: typing.Iterable[str], prefix: str = "") -> str:
    """' Did you mean 'section.key'? Valid keys: ...' for key `name` of section `prefix`."""
    valid = sorted(valid)
    close = [prefix + k for k in difflib.get_close_matches(name, valid, n=1)]
    if not close:  # a key given without its section (`steps=5`), or in the wrong one
        everywhere = _dotted_keys(Config)
        close = [k for k in everywhere if k.rsplit(".", 1)[-1] == name] or \
            difflib.get_close_matches(name, everywhere, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{hint} Valid keys: {', '.join(valid)}."


def _coerce(value: Any, typ: type, key: str) -> Any:
    """Checks `value` against a primitive field type; ints are accepted where floats are."""
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if key in COUNTS and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # a count of layers, as `key=3` or JSON's 3 give it
        if isinstance(value, str):
            allowed = CHOICES.get(key)
            counted = key in COUNTS and value.isdigit()
            if allowed and value not in allowed and not counted:
                counts = " or a number of layers" if key in COUNTS else ""
                raise ConfigError(f"{key}: '{value}' is not one of {', '.join(allowed)}"
                                  f"{counts}.")
            return value
    raise ConfigError(f"{key}: expected {typ.__name__}, got {type(value).__name__} {value!r}.")


def from_dict(cls: type, values: dict, prefix: str = "") -> Any:
    """Builds dataclass `cls` from a nested dict, checking every key and type."""
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {values!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"Unknown config key '{key}'.{_suggest(name, fields, prefix)}")
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            kwargs[name] = from_dict(typ, value, key + ".")
        else:
            kwargs[name] = _coerce(value, typ, key)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _parse_literal(text: str) -> Any:
    """`3` -> 3, `1e-4` -> 1e-4, `true` -> True, anything else stays a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_path(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: '{p}' is a value, not a section.")
    node[leaf] = value


def apply_overrides(values: dict, overrides: typing.Sequence[str]) -> dict:
    """Applies `a.b=c` strings to a nested dict (types are checked by `from_dict`)."""
    values = json.loads(json.dumps(values))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override '{item}' is not of the form section.key=value.")
        key, text = item.split("=", 1)
        _set_path(values, key.strip(), _parse_literal(text.strip()))
    return values


class _GinDelegate:
    def configurable_reference(self, name, evaluate):
        raise ConfigError(f"gin references (@{name}) are not supported in megatrain configs.")

    def macro(self, name):
        raise ConfigError(f"gin macros (%{name}) are not supported in megatrain configs.")


def _read_gin(path: Path) -> dict:
    try:
        from gin import config_parser
    except ImportError as e:
        raise ConfigError(
            f"{path} is a gin file, but gin-config is not installed. "
            "Install it with: pip install 'megatrain-jax[gin]'"
        ) from e
    values: dict = {}
    parser = config_parser.ConfigParser(_read_text(path), _GinDelegate())
    statements = iter(parser)
    while True:
        try:  # the parser reads lazily: a syntax error surfaces at its statement
            statement = next(statements)
        except StopIteration:
            return values
        except (SyntaxError, ValueError) as e:
            line, text = getattr(e, "lineno", None), (getattr(e, "text", None) or "").strip()
            reason = str(getattr(e, "msg", None) or e).strip().splitlines()[-1].strip(" .")
            raise ConfigError(f"{path}{f':{line}' if line else ''}: gin syntax error: {reason}"
                              + (f" (at `{text}`)" if text else "") + ".") from None
        where = f"{path}:{statement.location.line_num}"
        if isinstance(statement, config_parser.IncludeStatement):
            try:
                included = resolve_config_path(statement.filename, relative_to=path.parent)
            except ConfigError as e:
                raise ConfigError(f"{where}: include: {e}") from None
            for key, value in _flatten(_read_file(included)):
                _set_path(values, key, value)
        elif isinstance(statement, config_parser.BindingStatement):
            if statement.scope:
                raise ConfigError(f"{where}: gin scopes ({statement.scope}/) are not supported.")
            key = f"{statement.selector}.{statement.arg_name}"
            _check_binding(key, statement.value, where)
            _set_path(values, key, statement.value)
        else:
            raise ConfigError(f"{path}: unsupported gin statement {statement!r}.")


def _check_binding(key: str, value: Any, where: str) -> None:
    """Refuses a gin binding of an unknown key or a wrong type, naming its file and line."""
    try:
        single: dict = {}
        _set_path(single, key, value)
        from_dict(Config, single)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None


def _flatten(values: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in values.items():
        if isinstance(v, dict):
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def _read_file(path: Path) -> dict:
    if path.suffix == ".gin":
        return _read_gin(path)
    try:
        values = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a config is a JSON object of sections "
                          f'({{"model": {{...}}, ...}}), not a {type(values).__name__}.')
    base = values.pop("base", None)
    if base is not None:  # a config may extend another: {"base": "7b", ...}
        merged = _read_file(resolve_config_path(base, relative_to=path.parent))
        for key, value in _flatten(values):
            _set_path(merged, key, value)
        values = merged
    return values


def shipped_configs() -> dict[str, Path]:
    """Named configs shipped with the package: {'tiny': path, 'demo': path, ...}.

    Installed, they sit in `megatrain_jax/configs`; in a source checkout, in `configs/`
    beside the package.
    """
    here = Path(__file__).resolve().parent.parent
    for folder in (here / "configs", here.parent / "configs"):
        if folder.is_dir():
            return {p.stem: p for p in sorted(folder.glob("*.json")) + sorted(folder.glob("*.gin"))}
    return {}


def resolve_config_path(name: str, relative_to: Path | None = None) -> Path:
    """A config file: `name` beside the file that names it (`relative_to`), or from the
    working folder, or a shipped config, by name (`demo`) or as the docs spell it from a
    clone (`configs/demo.json`)."""
    for candidate in ((relative_to or Path.cwd()) / name, Path(name)):
        if candidate.is_file():
            return candidate
    shipped = shipped_configs()
    if name in shipped:
        return shipped[name]
    as_shipped = shipped.get(Path(name).stem)
    if as_shipped is not None and Path(name).name == as_shipped.name and \
            Path(name).parent.name == "configs":
        return as_shipped
    raise ConfigError(
        f"No config file '{name}', and no shipped config of that name. "
        f"Shipped configs: {', '.join(shipped)}."
    )


def load_config(name_or_path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Reads a shipped name or a file (JSON or gin), applies overrides, validates."""
    values = _read_file(resolve_config_path(name_or_path)) if name_or_path else {}
    values = apply_overrides(values, overrides)
    model = values.get("model")
    if isinstance(model, dict) and model.get("hf_path"):
        from megatrain_jax.config.hf import resolve_model_fields  # config.json, no weights

        values["model"] = resolve_model_fields(model)
    return validate(from_dict(Config, values))


def load_run_config(run_dir: str | Path) -> Config:
    """The resolved config a training run wrote to RUN_DIR/config.json."""
    file = Path(run_dir) / "config.json"
    if not file.is_file():
        raise ConfigError(f"{run_dir} has no config.json; is it a training run's folder?")
    try:
        return validate(from_dict(Config, json.loads(file.read_text())))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from e


def save_config(cfg: Config, path: str | Path) -> None:
    """Writes `cfg` as JSON, whole or not at all (a killed process leaves the old file)."""
    write_whole(Path(path), json.dumps(to_dict(cfg), indent=2) + "\n")


def write_whole(path: Path, text: str) -> None:
    """Writes `text` to `path` whole or not at all: a killed process leaves the old file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
