"""Reads what a checkpoint root holds (the only I/O behind the pure decisions in ``layout``)."""

from __future__ import annotations

import logging

from ..storage.fs import Storage
from . import layout

logger = logging.getLogger(__name__)


def scan(storage: Storage, names: list[str] | None = None) -> list[layout.Candidate]:
    """Every ``step-*`` directory with its manifest (None when absent) and its files.

    An unreadable manifest becomes ``{"unreadable": reason}``, which :func:`layout.verify`
    reports, so a damaged commit marker is skipped rather than trusted or crashed on."""
    out = []
    for name in storage.list_dirs() if names is None else names:
        step = layout.parse_step_dir(name)
        if step is None:
            continue
        files = storage.list_files(storage.join(name))
        manifest = None
        if layout.MANIFEST in files:
            try:
                manifest = storage.read_json(storage.join(name, layout.MANIFEST))
                if not isinstance(manifest, dict):
                    raise ValueError("not a JSON object")
            except (ValueError, OSError) as e:
                logger.warning("unreadable manifest in %s: %s", name, e)
                manifest = {"unreadable": str(e)}
        out.append(layout.Candidate(step, name, manifest, {k: v for k, v in files.items() if k != layout.MANIFEST}))
    return out


def ignored_entries(storage: Storage) -> list[str]:
    """Directories under the root that are not checkpoints (reported, never touched)."""
    return [n for n in storage.list_dirs() if layout.parse_step_dir(n) is None]
