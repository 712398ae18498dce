"""Pure functions: checkpoint naming, manifests, selection and retention. No I/O here.

A checkpoint is the directory ``step-XXXXXXXX/`` under the checkpoint root. It counts
(is *committed*) only when its ``manifest.json`` exists: rank 0 writes it after every rank's
shard write and DCP's ``.metadata`` are complete. A committed checkpoint is *valid* when every
file listed in the manifest exists with exactly the listed size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Candidate:
    """What discovery saw of one ``step-*`` directory."""

    step: int
    name: str
    manifest: dict[str, Any] | None  # None: uncommitted
    files: dict[str, int]  # relative name -> size, as listed in storage


def verify(c: Candidate) -> str | None:
    """None when ``c`` is committed and complete, else the reason it is not usable."""
    if c.manifest is None:
        return "uncommitted (no manifest)"
    if "unreadable" in c.manifest:
        return f"manifest unreadable: {c.manifest['unreadable']}"
    if c.manifest.get("step") != c.step:
        return f"manifest step {c.manifest.get('step')} does not match directory {c.name}"
    expected = c.manifest.get("files")
    if not isinstance(expected, dict) or not expected:
        return "manifest lists no files"
    for rel, size in sorted(expected.items()):
        if rel not in c.files:
            return f"file {rel} is missing"
        if c.files[rel] != size:
            return f"file {rel} has {c.files[rel]} bytes, manifest says {size}"
    return None


@dataclass
class Selection:
    chosen: Candidate | None
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (step, reason), newest first


def select_for_resume(candidates: list[Candidate], resume: str) -> Selection:
    """Pick the checkpoint to resume from.

    ``resume == "none"`` → nothing. ``"latest"`` → the newest valid one, falling back past
    invalid ones (each recorded in ``skipped``). A step number → exactly that one, or nothing
    with the reason in ``skipped`` (the caller turns that into an error).
    """
    sel = Selection(None)
    if resume == "none":
        return sel
    ordered = sorted(candidates, key=lambda c: c.step, reverse=True)
    if resume != "latest":
        want = int(resume)
        for c in ordered:
            if c.step == want:
                reason = verify(c)
                if reason is None:
                    sel.chosen = c
                else:
                    sel.skipped.append((c.step, reason))
                return sel
        sel.skipped.append((want, "no such checkpoint"))
        return sel
    for c in ordered:
        reason = verify(c)
        if reason is None:
            sel.chosen = c
            return sel
        sel.skipped.append((c.step, reason))
    return sel


def retention_victims(committed_steps: list[int], keep_last: int, keep_every: int, protected: set[int] = frozenset()) -> list[int]:
    """Committed steps to delete: all but the newest ``keep_last``, except multiples of
    ``keep_every`` (when > 0) and ``protected`` steps (e.g. the one resumed from)."""
    ordered = sorted(set(committed_steps), reverse=True)
    keep = set(ordered[:keep_last]) | set(protected)
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    return sorted(s for s in ordered if s not in keep)


def stale_uncommitted(candidates: list[Candidate]) -> list[Candidate]:
    """Leftovers of crashed saves: directories without a manifest. Only safe to delete when no
    save is in flight (at start-up, before the first save of this incarnation)."""
    return [c for c in candidates if c.manifest is None]


def should_save(step: int, total_steps: int, interval_steps: int, time_due: bool, preempt: bool) -> bool:
    """The cadence decision at the end of ``step`` (all inputs already agreed by all ranks)."""
    if preempt or step == total_steps:
        return True
    if interval_steps > 0 and step % interval_steps == 0:
        return True
    return time_due


def build_manifest(
    *,
    step: int,
    world_size: int,
    mesh_shape: list[int],
    files: dict[str, int],
    created: float,
    torch_version: str,
    fingerprint: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "version": MANIFEST_VERSION,
        "step": step,
        "world_size": world_size,
        "mesh_shape": mesh_shape,
        "time": created,
        "files": dict(sorted(files.items())),
        "total_bytes": sum(files.values()),
        "torch_version": torch_version,
        "config_fingerprint": fingerprint,
        **(extra or {}),
    }
