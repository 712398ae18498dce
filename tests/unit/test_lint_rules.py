"""The lint conventions ruff cannot check itself: every ``noqa`` marker names the rules it
suppresses and why (ruff's RUF100, selected in pyproject.toml, removes the ones that suppress
nothing)."""

import re
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
