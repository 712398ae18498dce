"""The user-facing documents against the code: the event table of docs/operations.md, the
configuration table of the README, the tests the README's guarantees cite, and words about
the machine a document was written on."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from elastic_trainer import config

REPO = Path(__file__).resolve().parents[2]


def _emitted() -> dict[str, set[str]]:
    """event name -> the fields the code passes to ``EventLog.emit`` (``**x`` is not a field)."""
    found: dict[str, set[str]] = {}
    for f in (REPO / "elastic_trainer").rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "emit" and n.args
                    and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)):
                found.setdefault(n.args[0].value, set()).update(k.arg for k in n.keywords if k.arg)
    sbatch = (REPO / "deploy" / "slurm" / "elastic-trainer.sbatch").read_text()
    for name, extra in re.findall(r'^event (\w+) "(.*)"$', sbatch, re.M):
        found.setdefault(name, {"job_id", "restart_count"}).update(re.findall(r'\\"(\w+)\\": ', extra))
    return found


def _event_table() -> dict[str, str]:
    """event name -> its row of the table in docs/operations.md."""
    text = (REPO / "docs" / "operations.md").read_text()
    rows = {}
    for line in text.split("## The event log", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = line.split("|")
        if len(cells) > 3 and "`" in cells[1]:
            for name in re.findall(r"`(\w+)`", cells[1]):
                rows[name] = cells[3]
    return rows


def test_every_event_the_code_writes_is_in_the_operations_table_with_its_fields():
    emitted, table = _emitted(), _event_table()
    assert len(emitted) > 30, sorted(emitted)
    missing = sorted(set(emitted) - set(table))
    assert not missing, f"events missing from docs/operations.md: {missing}"
    undocumented = {e: sorted(f - set(re.findall(r"`(\w+)`", table[e]))) for e, f in emitted.items()}
    undocumented = {e: f for e, f in undocumented.items() if f}
    assert not undocumented, f"fields missing from docs/operations.md: {undocumented}"
    stale = sorted(set(table) - set(emitted))
    assert not stale, f"documented events nothing writes: {stale}"


def test_every_config_key_is_in_the_readme_table():
    rows = [line.split("|")[1] for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `")]
    missing = []
    for section in dataclasses.fields(config.Config):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else getattr(config, section.type)):
            key = f"{section.name}.{f.name}"
            if not any(f"`{key}`" in r or (r.strip().startswith(f"`{section.name}.") and f"`{f.name}`" in r) for r in rows):
                missing.append(key)
    assert not missing, f"config keys missing from the README's configuration table: {missing}"


def _cited_tests() -> list[str]:
    readme = (REPO / "README.md").read_text()
    guaranteed = readme.split("Guaranteed (", 1)[1].split("Best effort:", 1)[0]
    return re.findall(r"`(tests/[\w/]+\.py::\w+(?:\[[\w-]+\])?)`", guaranteed)


def test_every_guarantee_names_bounded_tests_that_exist():
    readme = (REPO / "README.md").read_text()
    guaranteed = readme.split("Guaranteed (", 1)[1].split("Best effort:", 1)[0]
    bullets = re.split(r"\n- ", guaranteed)[1:]
    assert len(bullets) >= 10 and all("tests/" in b for b in bullets), [b[:60] for b in bullets if "tests/" not in b]
    for cited in _cited_tests():
        path, name = cited.split("::")
        param = None
        if "[" in name:
            name, param = name[:-1].split("[")
        source = (REPO / path).read_text()
        tree = ast.parse(source)
        [fn] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name] or [None]
        assert fn is not None, f"{cited}: no such test"
        assert not any("soak" in ast.unparse(d) for d in fn.decorator_list), f"{cited} is soak: not in the bounded suite"
        assert not re.search(r"^pytestmark\s*=.*soak", source, re.M), f"{cited}: the module is soak"
        if param:
            lines = [line for line in source.splitlines() if f'"{param}"' in line]
            assert lines and not any("soak" in line for line in lines), f"{cited}: no such case, or it is soak"


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")), "BENCHMARKS.md"])
def test_documents_speak_to_a_user_not_about_the_machine_they_were_written_on(doc):
    words = re.compile(r"other agents|this session|previous session|local disk|2-core machine", re.I)
    hits = [f"{doc}:{i}: {line}" for i, line in enumerate((REPO / doc).read_text().splitlines(), 1) if words.search(line)]
    assert not hits, "\n".join(hits)
