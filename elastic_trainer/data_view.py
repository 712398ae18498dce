"""The frozen data view: which files a run reads, recorded at its first start.

A view is a list of entries ``{"path", "size", "id"}`` (``path`` absolute, ``id`` a cheap
content identity: a hash of the size and the first and last :data:`IDENTITY_BYTES` bytes).
The first start of a run records the files it resolved from ``data.path``; the checkpoint
carries that list, and every resume reads exactly those files in that order, whatever the
directory or glob holds by then. Files added since are ignored (and reported); a recorded file
that vanished or changed is an error naming it: the sample order is a function of the packed
stream, so reading anything else would repeat or skip samples.

Pure functions and file stats only: the supervisor's preflight and the worker both call
:func:`check_data_view`.
"""

from __future__ import annotations

import hashlib
import json
import os

IDENTITY_BYTES = 64 << 10


def describe(path: str) -> dict | None:
    """The view entry of ``path`` as it is now, or None if it is not a readable file."""
    try:
        size = os.path.getsize(path)
        h = hashlib.sha256(str(size).encode())
        with open(path, "rb") as f:
            h.update(f.read(IDENTITY_BYTES))
            if size > IDENTITY_BYTES:
                f.seek(max(IDENTITY_BYTES, size - IDENTITY_BYTES))
                h.update(f.read(IDENTITY_BYTES))
    except OSError:
        return None
    return {"path": path, "size": size, "id": h.hexdigest()[:20]}


def describe_all(paths: list[str]) -> list[dict]:
    """Entries of the paths that exist now (missing ones are left out)."""
    return [e for e in (describe(p) for p in paths) if e is not None]


def check_data_view(recorded: list[dict], current: list[dict]) -> list[str]:
    """Problems that stop a resume: every recorded file that is missing from ``current`` or
    differs in size or content identity, one line each, naming the file. Empty: the recorded
    view can be read exactly. Files only in ``current`` are no problem (see :func:`added_files`)."""
    now = {e["path"]: e for e in current}
    problems = []
    for r in recorded:
        c = now.get(r["path"])
        if c is None:
            problems.append(f"{r['path']} is gone (it was read since the run's first start)")
        elif c["size"] != r["size"]:
            problems.append(f"{r['path']} changed: {r['size']} bytes at the run's first start, {c['size']} now")
        elif c["id"] != r["id"]:
            problems.append(f"{r['path']} changed: same size, different content than at the run's first start")
    return problems


def added_files(recorded: list[dict], current_paths: list[str]) -> list[str]:
    """Paths among ``current_paths`` that the recorded view does not read (ignored on resume)."""
    known = {r["path"] for r in recorded}
    return [p for p in current_paths if p not in known]


def encode(view: list[dict]) -> str:
    return json.dumps(view, sort_keys=True, separators=(",", ":"))


def summary(view: list[dict]) -> dict:
    """What every manifest records of the view: its length and the SHA-256 of its encoding. A
    view resolved now with the same summary is the recorded one, entry for entry."""
    return {"files": len(view), "sha256": hashlib.sha256(encode(view).encode()).hexdigest()}


def decode(text: str) -> list[dict]:
    view = json.loads(text)
    if not isinstance(view, list) or not all(isinstance(e, dict) and {"path", "size", "id"} <= set(e) for e in view):
        raise ValueError("not a data view (a list of {path, size, id})")
    return view
