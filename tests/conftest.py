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
