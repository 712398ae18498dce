"""Every test directory is collected by the README's test command (pytest skips directories
that match ``norecursedirs``; its default includes ``dist``, which once hid tests/dist)."""

from fnmatch import fnmatch
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_directory_is_skipped_by_norecursedirs(pytestconfig):
    patterns = pytestconfig.getini("norecursedirs")
    dirs = {p.parent for p in TESTS.rglob("test_*.py")}
    assert len(dirs) >= 4  # unit, contract, dist, e2e
    for d in dirs:
        for part in d.relative_to(TESTS.parent).parts:
            hit = [pat for pat in patterns if fnmatch(part, pat)]
            assert not hit, f"{d}: the directory {part!r} matches norecursedirs {hit}: its tests would never run"
