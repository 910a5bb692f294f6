"""The documentation against the code: every config key in docs/config.md with its type,
default and choices; links that lead somewhere; no session history in the user's docs."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from megatrain_jax.config import schema

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "config.md"
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED_DOCS = [*USER_DOCS, ROOT / "benchmarks" / "RESULTS.md", ROOT / "benchmarks" / "README.md",
               ROOT / "benchmarks" / "investigations" / "README.md"]

# Keys documented before they land in the schema: the placement planner's budget. Remove a
# key from here in the change that adds it to config/schema.py (a test below insists).
PENDING: set[str] = set()


def schema_fields(cls=schema.Config, prefix: str = "") -> dict[str, tuple]:
    """Every leaf key of the config as section.key (section.sub.key when nested): its
    dataclass field and its type."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            found.update(schema_fields(hints[f.name], f"{prefix}{f.name}."))
        else:
            found[prefix + f.name] = (f, hints[f.name])
    return found


def documented_rows(doc: Path = CONFIG_DOC) -> list[list[str]]:
    """docs/config.md's table rows of keys: [key, type, default, range, meaning]."""
    rows = []
    for line in doc.read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append([cells[0].strip("`"), *cells[1:]])
    return rows


def default_text(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(value, bool):
        return "true" if value else "false"
    return '""' if value == "" else str(value)


def undocumented(doc: Path = CONFIG_DOC) -> list[str]:
    return sorted(set(schema_fields()) - {row[0] for row in documented_rows(doc)})


def test_every_schema_key_is_documented_once():
    keys = [row[0] for row in documented_rows()]
    duplicated = sorted({k for k in keys if keys.count(k) > 1})
    assert not duplicated, f"docs/config.md lists these keys twice: {duplicated}"
    assert not undocumented(), f"docs/config.md lacks these config keys: {undocumented()}"


def test_every_documented_key_exists():
    unknown = sorted({row[0] for row in documented_rows()} - set(schema_fields()) - PENDING)
    assert not unknown, f"docs/config.md lists keys the schema does not have: {unknown}"


def test_pending_keys_are_not_yet_in_the_schema():
    landed = sorted(PENDING & set(schema_fields()))
    assert not landed, f"{landed} landed in the schema: remove them from PENDING"


def test_types_defaults_and_choices_match_the_schema():
    fields = schema_fields()
    wrong = []
    for key, typ, default, accepted, _ in documented_rows():
        if key not in fields:
            continue
        f, field_type = fields[key]
        if typ != field_type.__name__:
            wrong.append(f"{key}: type {typ!r}, the schema's {field_type.__name__!r}")
        if default != default_text(f):
            wrong.append(f"{key}: default {default!r}, the schema's {default_text(f)!r}")
        absent = [c for c in schema.CHOICES.get(key, ()) if f"`{c}`" not in accepted]
        if absent:
            wrong.append(f"{key}: the range does not name {absent}")
    assert not wrong, "docs/config.md disagrees with config/schema.py:\n" + "\n".join(wrong)


def test_a_missing_key_would_be_found(tmp_path):
    doc = tmp_path / "config.md"
    doc.write_text("\n".join(line for line in CONFIG_DOC.read_text().splitlines()
                             if not line.startswith("| `loop.seed`")))
    assert undocumented(doc) == ["loop.seed"]


# What the check greps for: call letters of benchmark sessions, commit hashes; and
# ISO dates. Users read the docs as the project is now; RESULTS.md keeps the dates.
HISTORY = re.compile(r"call [A-Z]|same call|[0-9a-f]{7,}\b|\b20\d\d-\d\d-\d\d\b")


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: p.name)
def test_user_docs_hold_no_session_history(doc):
    hits = [f"{doc.name}:{n}: {line.strip()}" for n, line in
            enumerate(doc.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, "\n".join(hits)


def test_readme_and_results_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    assert len((ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 400


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {github_anchor(line.lstrip("#")) for line in doc.read_text().splitlines()
            if line.startswith("#")}


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{doc.name}:\n" + "\n".join(broken)


RESULTS = ROOT / "benchmarks" / "RESULTS.md"
RESULT_FILES = ROOT / "benchmarks" / "results"


def cited_results(text: str) -> set[str]:
    """The raw files RESULTS.md names, as `DIR/FILE` or, after one in the same table row or
    paragraph, as `FILE` in that DIR."""
    cited, folder = set(), None
    for line in text.splitlines():
        if not line.strip() or line.startswith("|"):
            folder = None
        for name in re.findall(r"`([^`\s]+\.(?:json|jsonl|png|txt|log|sh|tgz))`", line):
            if "/" in name:
                folder = name.split("/")[0]
                cited.add(name)
            elif folder is not None:
                cited.add(f"{folder}/{name}")
    return {name for name in cited if re.match(r"20\d\d-\d\d-\d\d_", name)}


def test_results_folder_holds_what_results_md_cites():
    cited = cited_results(RESULTS.read_text())
    held = {str(p.relative_to(RESULT_FILES)) for p in RESULT_FILES.rglob("*") if p.is_file()}
    assert not sorted(cited - held), f"RESULTS.md cites files not in results/: {cited - held}"
    assert not sorted(held - cited), f"results/ holds files RESULTS.md does not cite (git rm " \
                                     f"them; history keeps them): {sorted(held - cited)}"
