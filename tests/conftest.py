"""Shared pytest configuration.

Fixture modules live in ``tests/fixtures/`` and are registered here so every
test directory can use them. Each fixture starts only the processes it needs on
127.0.0.1 and stops exactly those (by PID) when it is done.
"""
import importlib.util

_FIXTURE_MODULES = [
    "tests.fixtures.procs",
    "tests.fixtures.s3",
    "tests.fixtures.faultproxy",
    "tests.fixtures.prometheus",
    "tests.fixtures.slurm",
]

pytest_plugins = [m for m in _FIXTURE_MODULES if importlib.util.find_spec(m) is not None]


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> str:
    """A ~1 MB byte-level token file built from the standard library's sources."""
    from elastic_trainer.worker.data import build_token_file, default_demo_texts

    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    build_token_file(default_demo_texts(1 << 20), str(path))
    return str(path)
