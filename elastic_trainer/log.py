"""Logging with a ``[node/rank - step N]`` prefix. Never touches the root logger's handlers
unless :func:`setup_logging` is called by an entry point."""

from __future__ import annotations

import logging
import os
import sys

from . import contract

_STATE = {"step": "-"}


def set_step(step: int | str) -> None:
    _STATE["step"] = str(step)


class _PrefixFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.et_rank = os.environ.get(contract.RANK_ENV, "-")
        record.et_node = os.environ.get(contract.GROUP_RANK_ENV, os.environ.get(contract.NODE_ENV, "-"))
        record.et_step = _STATE["step"]
        return True


class _Handler(logging.StreamHandler):
    """The handler :func:`setup_logging` adds (what :func:`forget_setup` removes)."""


def setup_logging(level: str | int | None = None) -> None:
    """Entry points (the CLI, the worker, ``elastic_trainer.init``) call this. Only the
    ``elastic_trainer`` logger gets a handler, and only when it has none yet: a program that
    configured that logger itself keeps its own. Level: ``level``, else
    ``ELASTIC_TRAINER_LOG_LEVEL``, else INFO."""
    level = level or os.environ.get(contract.LOG_LEVEL_ENV, "INFO")
    logger = logging.getLogger("elastic_trainer")
    if logger.handlers:
        return
    handler = _Handler(sys.stderr)
    handler.addFilter(_PrefixFilter())
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s %(levelname)s [%(et_node)s/%(et_rank)s - step %(et_step)s] %(name)s: %(message)s"
        )
    )
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def forget_setup() -> None:
    """Undo :func:`setup_logging` in a process forked from an entry point that is to behave as a
    fresh interpreter (the warm-start zygote): its workers set logging up themselves."""
    logger = logging.getLogger("elastic_trainer")
    ours = [h for h in logger.handlers if isinstance(h, _Handler)]
    if not ours:
        return
    for handler in ours:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
