"""Shared pytest configuration.

Fixture modules live in ``tests/fixtures/`` and are registered here so every
test directory can use them. Each fixture starts only the processes it needs on
127.0.0.1 and stops exactly those (by PID) when it is done.
"""

import importlib.util
import os

import pytest

from elastic_trainer.events import EventLog

_FIXTURE_MODULES = [
    "tests.fixtures.procs",
    "tests.fixtures.s3",
    "tests.fixtures.faultproxy",
    "tests.fixtures.prometheus",
    "tests.fixtures.slurm",
    "tests.fixtures.netcluster",
    "tests.fixtures.rendezvous",
]

pytest_plugins = [m for m in _FIXTURE_MODULES if importlib.util.find_spec(m) is not None]

# Every event an in-process test makes the code write must fit the catalogue (contract.EVENTS).
EventLog.check = True


def pytest_collection_modifyitems(config, items):
    """``soak`` tests repeat what the bounded suite already covers; they run only with
    ELASTIC_TRAINER_SOAK=1 (the chaos suite's random rounds also grow from 1 to 25 then)."""
    if os.environ.get("ELASTIC_TRAINER_SOAK") == "1":
        return
    skip = pytest.mark.skip(reason="soak test: set ELASTIC_TRAINER_SOAK=1 to run")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> str:
    """A ~1 MB byte-level token file built from the standard library's sources."""
    from elastic_trainer.worker.tokens import build_token_file, default_demo_texts

    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    build_token_file(default_demo_texts(1 << 20), str(path))
    return str(path)
