"""The lint conventions ruff cannot check itself: every ``noqa`` marker names the rules it
suppresses and why (ruff's RUF100, selected in pyproject.toml, removes the ones that suppress
nothing); and CI type-checks the whole package (mypy, pyproject.toml's [tool.mypy])."""

import ast
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


def _own_private_names() -> set[str]:
    """Every private method and instance attribute the package's own classes define."""
    names: set[str] = set()
    for path in (REPO / "elastic_trainer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name.startswith("_"):
                        names.add(item.name)
                    if (
                        isinstance(item, ast.Attribute)
                        and isinstance(item.ctx, ast.Store)
                        and getattr(item.value, "id", "") == "self"
                        and item.attr.startswith("_")
                    ):
                        names.add(item.attr)
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def test_no_private_access_into_the_package_s_own_classes():
    """A ``noqa: SLF001`` may reach into another library's privates (argparse, fsspec, a torch
    scheduler), never into one of ours: what one of our classes needs from another is public."""
    own = _own_private_names()
    assert {"_run", "_ended", "_check"} <= own  # the walk finds our own
    found = [
        f"{path.relative_to(REPO)}:{n}: {attr}"
        for path in sorted((REPO / "elastic_trainer").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "noqa: SLF001" in line
        for attr in re.findall(r"\.(_[A-Za-z]\w*)", line.split("#")[0])
        if attr in own
    ]
    assert not found, "private access into the package's own classes:\n" + "\n".join(found)


def test_no_function_over_60_lines_and_no_class_over_10_public_methods():
    """The reader's limits: a function reads in one screen (60 lines, its docstring included);
    a class has at most 10 public methods of its own — properties, and the overrides of a base
    class from another library (a Lightning strategy's hooks, torch's ``StorageWriter`` API),
    are not its own API."""
    import importlib
    import inspect

    long, big = [], []
    for path in sorted((REPO / "elastic_trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
        module = importlib.import_module(
            ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        )
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            foreign = {
                n for base in cls.__mro__[1:] if not base.__module__.startswith("elastic_trainer") for n in vars(base)
            }
            own = [
                n for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v) and n not in foreign
            ]
            if len(own) > 10:
                big.append(f"{cls.__module__}.{cls.__qualname__}: {len(own)} {own}")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
    assert not big, "classes with more than 10 public methods:\n" + "\n".join(big)
