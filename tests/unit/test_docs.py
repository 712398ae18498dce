"""The user-facing documents against the code: the event table of docs/operations.md (generated
from the event catalogue, which tests/unit/test_contract.py checks against the code), the
configuration table of the README, the tests the README's guarantees cite, and words about
the machine a document was written on."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from elastic_trainer import config, contract

REPO = Path(__file__).resolve().parents[2]


def test_the_operations_event_table_is_the_catalogue():
    text = (REPO / "docs" / "operations.md").read_text()
    begin, end = "<!-- generated from elastic_trainer/contract.py", "<!-- end of the generated event table -->"
    assert text.count(begin) == 1 and text.count(end) == 1, "docs/operations.md lost the markers of its event table"
    section = text.split("## The event log", 1)[1].split("\n## ", 1)[0]
    assert begin in section, "the event table left the section 'The event log'"
    table = text.split(begin, 1)[1].split("\n", 1)[1].split(end, 1)[0]
    assert table == contract.events_table(), (
        "docs/operations.md's event table is stale: regenerate it with `python -m elastic_trainer.contract`"
    )


def test_every_config_key_is_in_the_readme_table():
    rows = [line.split("|")[1] for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `")]
    missing = []
    for section in dataclasses.fields(config.Config):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else getattr(config, section.type)):
            key = f"{section.name}.{f.name}"
            if not any(
                f"`{key}`" in r or (r.strip().startswith(f"`{section.name}.") and f"`{f.name}`" in r) for r in rows
            ):
                missing.append(key)
    assert not missing, f"config keys missing from the README's configuration table: {missing}"


def test_the_front_end_tables_name_every_train_and_checkpoint_key_once_for_each_front_end():
    """docs/configuration.md: one row per ``train.*``/``checkpoint.*`` key (a row may list several of
    one section), each with a cell for the built-in trainer, the own loop, Lightning and Accelerate."""
    text = (REPO / "docs" / "configuration.md").read_text()
    for section, cls in (("train", config.TrainConfig), ("checkpoint", config.CheckpointConfig)):
        table = text.split(f"## `{section}.*`", 1)[1].split("\n## ", 1)[0]
        rows = [line for line in table.splitlines() if line.startswith(f"| `{section}.")]
        assert all(line.count(" | ") == 4 for line in rows), "a row without a cell per front end"
        named = [k.strip().strip("`").removeprefix(f"{section}.") for r in rows for k in r.split("|")[1].split(",")]
        keys = [f.name for f in dataclasses.fields(cls)]
        assert sorted(named) == sorted(keys), f"docs/configuration.md's {section}.* table: {named} vs {keys}"


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
        assert not any("soak" in ast.unparse(d) for d in fn.decorator_list), (
            f"{cited} is soak: not in the bounded suite"
        )
        assert not re.search(r"^pytestmark\s*=.*soak", source, re.M), f"{cited}: the module is soak"
        if param:
            lines = [line for line in source.splitlines() if f'"{param}"' in line]
            assert lines and not any("soak" in line for line in lines), f"{cited}: no such case, or it is soak"


@pytest.mark.parametrize(
    "doc", ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")), "BENCHMARKS.md"]
)
def test_documents_speak_to_a_user_not_about_the_machine_they_were_written_on(doc):
    words = re.compile(r"other agents|this session|previous session|local disk|2-core machine", re.I)
    hits = [
        f"{doc}:{i}: {line}" for i, line in enumerate((REPO / doc).read_text().splitlines(), 1) if words.search(line)
    ]
    assert not hits, "\n".join(hits)
