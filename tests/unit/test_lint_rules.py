"""The lint conventions ruff cannot check itself: every ``noqa`` marker names the rules it
suppresses and why (ruff's RUF100, selected in pyproject.toml, removes the ones that suppress
nothing); and CI type-checks the whole package (mypy, pyproject.toml's [tool.mypy])."""

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKED = ("elastic_trainer", "bench", "examples", "tests")
MARKER = re.compile(r"#\s*noqa\b(?P<rest>.*)")
WITH_REASON = re.compile(r": [A-Z]+[0-9]+(, [A-Z]+[0-9]+)* - \S")


def markers_without_reason(text: str) -> list[tuple[int, str]]:
    return [
        (n, line.strip())
        for n, line in enumerate(text.splitlines(), 1)
        if (m := MARKER.search(line)) and not WITH_REASON.match(m.group("rest"))
    ]


def test_the_check_tells_a_reason_from_none():
    q = "# " + "noqa"  # not spelled out: this file is checked too
    assert markers_without_reason(f"x = 1  {q}: E731 - a reason\n") == []
    assert markers_without_reason(f"x = 1  {q}: E731, F401 - a reason\n") == []
    for bad in (f"{q}", f"{q}: E731", f"{q}: E731 -", f"{q} - why", f"{q}:E731 - why"):
        assert markers_without_reason(f"x = 1  {bad}\n") == [(1, f"x = 1  {bad}")], bad


def test_every_noqa_names_its_rules_and_reason():
    missing = [
        f"{path.relative_to(REPO)}:{n}: {line}"
        for top in CHECKED
        for path in sorted((REPO / top).rglob("*.py"))
        for n, line in markers_without_reason(path.read_text())
    ]
    assert not missing, "name the rules and the reason (`CODE - reason`):\n" + "\n".join(missing)


def test_ci_type_checks_the_whole_package():
    """scripts/test.sh runs mypy with pyproject's [tool.mypy] (pinned in the test extra): on the
    package, no module skipped, a missing import tolerated only for named third-party packages."""
    script = (REPO / "scripts" / "test.sh").read_text()
    assert re.search(r"^\.venv/bin/mypy$", script, re.M), "scripts/test.sh runs .venv/bin/mypy"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert any(re.fullmatch(r"mypy==[\d.]+", r) for r in project["project"]["optional-dependencies"]["test"])
    mypy = project["tool"]["mypy"]
    assert mypy["files"] == ["elastic_trainer"] and mypy["check_untyped_defs"] is True
    assert not {"ignore_errors", "ignore_missing_imports"} & set(mypy)
    for override in mypy.get("overrides", []):
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        assert "ignore_errors" not in override, modules
        assert not any(m.split(".")[0] == "elastic_trainer" for m in modules), modules
