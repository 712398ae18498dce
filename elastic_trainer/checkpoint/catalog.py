"""The catalog of a checkpoint root: the one home of rank 0's checkpoint bookkeeping.

Scanning, verification, resume planning (lineage, past commits an audit found suspect), commit,
quarantine, retention, cleanup and fencing live here; the supervisor's
preflight, the checkpoint manager (rank 0) and the ``ckpt`` tools all use this class. It is
thread-safe (the manager commits from a background thread).

Fencing: every launch takes an *epoch* under ``_epochs/`` (``NNNNNNNN-<launch id>.json``, the
number one above the newest; a race for the same number is broken by the id, the same way for
everyone). A writer checks that its epoch is still the newest before every commit, clean and
delete, and otherwise raises :class:`FencedError` naming the newer launch. A relaunch never waits.

Lineage: each manifest records its epoch, a per-lineage sequence number and its parent (the
checkpoint its state descends from). The epoch record stores the *base* a launch started from,
so every restart inside a launch resumes from the newest commit of that launch (or its base),
whatever ``checkpoint.resume`` said for the first start. Commits not on the current lineage are
*parked*: never picked by ``latest``, never counted or deleted by retention, shown by ``ckpt list``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import contract
from ..errors import CheckpointError, FencedError
from ..events import EventLog
from ..storage.fs import Storage, read_json, write_json_atomic
from . import layout

logger = logging.getLogger(__name__)

EPOCHS = "_epochs"
_UNSET: Any = object()


def checkpoint_key() -> bytes | None:
    """The manifest signing key from ``ELASTIC_TRAINER_CHECKPOINT_KEY`` (never logged)."""
    raw = os.environ.get(contract.CHECKPOINT_KEY_ENV, "")
    return raw.encode() if raw else None


def _launch_slug(launch_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", launch_id)[:80] or "launch"


@dataclass
class ResumePlan:
    chosen: layout.Candidate | None
    skipped: list[tuple[int, str]] = field(default_factory=list)
    first_start: bool = True
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (name, reason): content that fails its seal
    unusable: list[tuple[str, str]] = field(default_factory=list)  # (name, reason): commits of the lineage skipped
    incompatible: tuple[str, str] | None = None  # (name, reason): a commit in a format this version does not read

    def skip(self, c: layout.Candidate, reason: str) -> None:
        """``c`` is not loaded for ``reason``; a deterministic one (its content) quarantines it."""
        self.skipped.append((c.step, reason))
        self.unusable.append((c.name, reason))
        if c.quarantine is None and layout.is_corruption(reason):
            self.corrupt.append((c.name, reason))

    def stop_reason(self) -> str | None:
        """Why this start must stop (exit 2) instead of training: the newest commit of the lineage
        is in a format this version does not read (falling back would drop newer work), or
        commits exist but none is usable (training from step 0 would silently discard them)."""
        if self.incompatible is not None:
            name, reason = self.incompatible
            return f"checkpoint {name}: {reason}; nothing was quarantined or changed"
        if self.chosen is None and self.unusable:
            listed = "; ".join(f"{n} ({r})" for n, r in self.unusable[:5]) + (
                f"; and {len(self.unusable) - 5} more" if len(self.unusable) > 5 else ""
            )
            return (
                f"{len(self.unusable)} committed checkpoint(s) of this run exist but none can be loaded: {listed}. "
                "Not starting over from step 0. Ways forward: "
                "'elastic-trainer ckpt release URI --step N' re-verifies a "
                "quarantined checkpoint and lifts the quarantine if "
                "its bytes are good; a missing file may be storage that "
                "has not caught up (start again later); or start a new run: another checkpoint.dir, or "
                'checkpoint.resume = "none" for this launch'
            )
        return None


def _step_dir(name: str) -> tuple[int, int]:
    """(step, generation) of a name the listing kept: a step directory's."""
    parsed = layout.parse_dir(name)
    assert parsed is not None
    return parsed


class Catalog:
    """The checkpoints under one root (``storage``), as rank 0, the preflight and the tools see them.

    It reads (scan, verification, DCP readers), plans resumes (lineage) and commits; its
    collaborators own the rest: :attr:`fence` (:class:`Fence`: the launch epochs and fencing),
    :attr:`quarantine` (:class:`Quarantine`: marking and releasing bad commits) and :attr:`pruner`
    (:class:`Pruner`: retention and the cleanup of uncommitted leftovers).

    ``epoch``: this launch's fencing epoch (:meth:`Fence.acquire` takes one); every commit, clean
    and delete checks it first. ``key``: the manifest signing key (default: from
    ``ELASTIC_TRAINER_CHECKPOINT_KEY``; None: manifests unsigned). ``events``: where it reports
    what it changes (a new epoch, a quarantine or release, a deletion). Thread-safe; keeps nothing
    of the root between calls (each call lists it afresh), so catalogs over one root agree."""

    def __init__(
        self,
        storage: Storage,
        *,
        epoch: str | None = None,
        key: bytes | None = _UNSET,
        events: EventLog | None = None,
        certified_only: bool = False,
    ):
        self.storage = storage
        self.certified_only = certified_only  # checkpoint.resume_certified_only: `latest` loads certified commits only
        self.key = checkpoint_key() if key is _UNSET else key
        self.events = events or EventLog(None)
        self._lock = threading.RLock()  # every change under the root holds it, the collaborators' too
        self.fence = Fence(storage, epoch=epoch, events=self.events, lock=self._lock)
        self.quarantine = Quarantine(self, lock=self._lock)
        self.pruner = Pruner(self, lock=self._lock)

    @property
    def epoch(self) -> str | None:
        """This launch's fencing epoch (the :attr:`fence`'s)."""
        return self.fence.epoch

    @epoch.setter
    def epoch(self, epoch: str | None) -> None:
        self.fence.epoch = epoch

    # ------------------------------------------------------------------ reading
    def scan(self) -> list[layout.Candidate]:
        """Every ``step-*`` directory with its manifest, quarantine and writer markers and files.

        One recursive listing of the root. An unreadable manifest becomes ``{"unreadable": why}``,
        which :func:`layout.verify` reports, so a damaged commit marker is skipped, never trusted."""
        out = []
        for name, files in sorted(self._listing().items()):
            step, _ = _step_dir(name)
            manifest = self._read_marker(name, layout.MANIFEST, files, unreadable_ok=True)
            quarantine = self._read_marker(name, layout.QUARANTINE, files)
            writer = self._read_marker(name, layout.WRITER, files) if manifest is None else None
            audit = self._read_marker(name, layout.AUDIT, files) if manifest is not None else None
            plain = {k: v for k, v in files.items() if k not in layout.MARKERS}
            markers = tuple(sorted(k for k in files if k in layout.MARKERS))
            out.append(layout.Candidate(step, name, manifest, plain, quarantine, writer, audit, markers))
        return out

    def _listing(self) -> dict[str, dict[str, int]]:
        """``step-*`` directory -> its files (relative name -> size): one recursive listing."""
        per_dir: dict[str, dict[str, int]] = {}
        for rel, size in self.storage.list_files(self.storage.root).items():
            top, sep, rest = rel.partition("/")
            if sep and layout.parse_dir(top) is not None:
                per_dir.setdefault(top, {})[rest] = size
        for name in self.storage.list_dirs():
            if layout.parse_dir(name) is not None:
                per_dir.setdefault(name, {})  # an empty directory is an uncommitted leftover
        return per_dir

    def names(self) -> tuple[list[str], str | None, list[str]]:
        """What the listing alone says, reading no object: every ``step-*`` directory's name; the
        newest (by step, then generation) that lists a commit marker and no quarantine marker:
        committed by its name, *not verified* (None: there is none); and those that list no
        commit marker (uncommitted)."""
        per_dir = self._listing()
        marked = [n for n, f in per_dir.items() if layout.MANIFEST in f and layout.QUARANTINE not in f]
        unmarked = sorted(n for n, f in per_dir.items() if layout.MANIFEST not in f)
        return sorted(per_dir), max(marked, key=_step_dir, default=None), unmarked

    def _read_marker(
        self, name: str, marker: str, files: dict[str, int], unreadable_ok: bool = False
    ) -> dict[str, Any] | None:
        if marker not in files:
            return None
        try:
            data = read_json(self.storage, self.storage.join(name, marker))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data
        except (ValueError, OSError) as e:
            logger.warning("unreadable %s in %s: %s", marker, name, e)
            if not unreadable_ok:
                return {"reason": f"unreadable {marker}: {e}"}
            # bytes that are no JSON object are damage; a read that failed may be the storage's moment
            return {"unreadable": str(e), "read_failed": isinstance(e, OSError)}

    def ignored_entries(self) -> list[str]:
        """Directories under the root that are neither checkpoints nor reserved (reported, never touched)."""
        return [n for n in self.storage.list_dirs() if layout.parse_dir(n) is None and not layout.is_reserved(n)]

    def problem(self, c: layout.Candidate) -> str | None:
        return layout.verify(c, self.key)

    def reader(self, c: layout.Candidate):
        """A DCP storage reader for a *verified* candidate that checks every byte it reads."""
        problem = self.problem(c)
        if problem:
            raise CheckpointError(f"checkpoint {c.name} is unusable: {problem}")
        from . import integrity  # torch's DCP: the supervisor's checks before start need none of it

        assert c.manifest is not None  # verified
        return integrity.verifying(
            self.storage.dcp.reader(self.storage.join(c.name)), layout.Checks.from_manifest(c.manifest)
        )

    def read_metadata(self, c: layout.Candidate):
        """DCP metadata of a verified candidate (checked against the manifest before unpickling)."""
        return self.reader(c).read_metadata()

    # ------------------------------------------------------------------ resume planning
    def plan_resume(
        self,
        resume: str,
        exclude: frozenset[str] = frozenset(),
        *,
        candidates: list[layout.Candidate] | None = None,
    ) -> ResumePlan:
        """Which checkpoint this start loads (pure decisions over one scan; ``candidates``:
        :meth:`scan` as just read, else read here). A restart of this launch reads its own epoch's
        record only; a first start every epoch's."""
        candidates = self.scan() if candidates is None else candidates
        mine = self.fence.record(self.epoch) if self.epoch else {}
        restart = "base" in mine
        if restart:
            assert self.epoch is not None  # a record is read only with an epoch
            order = self._lineage_order(candidates, {self.epoch: mine}, only=self.epoch)
        elif resume == "none":
            return ResumePlan(None, [], True)
        elif resume != "latest":
            sel = layout.select_for_resume(candidates, resume, self.key, exclude)
            return ResumePlan(sel.chosen, sel.skipped, True)
        else:
            order = self._lineage_order(candidates, self.fence.records())
        plan = ResumePlan(None, [], not restart)
        suspects = layout.suspect_reasons(candidates)
        if self.certified_only:
            suspects = {**layout.uncertified_reasons(candidates), **suspects}
        # Leftovers of crashed saves are reported (and cleaned at start-up), never loaded.
        plan.skipped += [
            (c.step, "uncommitted (no manifest)")
            for c in sorted(candidates, key=lambda c: c.step, reverse=True)
            if c.manifest is None and c.name not in exclude
        ]
        for c in order:
            if c.manifest is None:
                continue
            if c.name in exclude:
                continue
            reason = suspects.get(c.name) or self.problem(c)
            if reason is None:
                plan.chosen = c
                break
            if layout.is_format_problem(reason):
                plan.incompatible = (c.name, reason)
                break
            plan.skip(c, reason)
        # A manifest that cannot be read names no lineage, so the order above may never reach it
        # (an older commit of the lineage loads first): one newer than what loads is still skipped
        # by name, and quarantined when its bytes are the problem.
        reported = exclude | {n for n, _ in plan.unusable}
        for c in candidates:
            newer = plan.chosen is None or (c.step, c.gen) > (plan.chosen.step, plan.chosen.gen)
            if newer and c.manifest is not None and "unreadable" in c.manifest and c.name not in reported:
                problem = self.problem(c)
                assert problem is not None  # an unreadable manifest is one
                plan.skip(c, problem)
        return plan

    def _lineage_order(
        self, candidates: list[layout.Candidate], epochs: dict[str, dict[str, Any]], only: str | None = None
    ) -> list[layout.Candidate]:
        """Candidates in the order ``latest`` tries them: per epoch (newest first) its commits
        newest first, then the base it started from (with that base's ancestors); then every
        other directory by step. With ``only``: that epoch's commits and base chain only."""
        by_name = {c.name: c for c in candidates}
        out: list[layout.Candidate] = []
        seen: set[str] = set()

        def add(c: layout.Candidate | None) -> None:
            while c is not None and c.name not in seen:
                seen.add(c.name)
                out.append(c)
                parent = (c.manifest or {}).get("parent")
                c = by_name.get(parent) if isinstance(parent, str) else None

        names = [only] if only else sorted(epochs, key=layout.epoch_key, reverse=True)
        for e in names:
            own = [c for c in candidates if c.manifest and c.manifest.get("epoch") == e]
            for c in sorted(own, key=lambda c: ((c.manifest or {}).get("seq", 0), c.step, c.gen), reverse=True):
                add(c)
            base = epochs.get(e, {}).get("base")
            if isinstance(base, str):
                add(by_name.get(base))
        if not only:  # then everything else, uncommitted leftovers included (reported as skipped)
            for c in sorted(candidates, key=lambda c: (c.step, c.gen), reverse=True):
                add(c)
        return out

    def head(self, candidates: list[layout.Candidate] | None = None) -> layout.Candidate | None:
        """What ``latest`` would resume from now (never a suspect commit nor one descending from it)."""
        candidates = self.scan() if candidates is None else candidates
        suspects = layout.suspect_reasons(candidates)
        for c in self._lineage_order(candidates, self.fence.records()):
            if c.name not in suspects and self.problem(c) is None:
                return c
        return None

    # ------------------------------------------------------------------ writing (rank 0)
    def mark_writer(self, name: str) -> None:
        """Record which epoch writes the (uncommitted) directory ``name``."""
        write_json_atomic(self.storage, self.storage.join(name, layout.WRITER), {"epoch": self.epoch or ""})

    def commit(
        self,
        name: str,
        *,
        step: int,
        world_size: int,
        mesh_shape: list[int],
        fingerprint: str,
        torch_version: str,
        extra: dict[str, Any],
    ) -> dict[str, Any]:
        """Prove the save complete and write its manifest (the commit marker).

        The file list comes from what DCP wrote (``.checksums.json``, built from every rank's
        write results); each file must be in storage with the size written. Raises
        CheckpointError (not committed) or FencedError."""
        with self._lock:
            self.fence.check()
            d = self.storage.join(name)
            try:
                table = read_json(self.storage, self.storage.join(name, layout.CHECKSUMS))
                written = table["files"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(
                    f"cannot commit {name}: no readable {layout.CHECKSUMS} from DCP's writer ({type(e).__name__}: {e})"
                ) from e
            listed = self.storage.list_files(d)
            problem = layout.commit_problem(written, listed)
            if problem is None and self.epoch and layout.WRITER in listed:
                writer = self._read_marker(name, layout.WRITER, listed) or {}
                if writer.get("epoch") != self.epoch:  # two launches wrote one directory: mixed files
                    problem = (
                        "directory is being written by another launch "
                        f"(epoch {writer.get('epoch')!r}, ours {self.epoch})"
                    )
            if problem:
                raise CheckpointError(f"cannot commit {name}: {problem}")
            manifest = layout.build_manifest(
                step=step,
                world_size=world_size,
                mesh_shape=mesh_shape,
                files=written,
                created=time.time(),
                torch_version=torch_version,
                fingerprint=fingerprint,
                epoch=self.epoch or "",
                extra=extra,
            )
            manifest = layout.seal(manifest, self.key)
            write_json_atomic(self.storage, self.storage.join(name, layout.MANIFEST), manifest)
            return manifest


def lineage(head: layout.Candidate | None, candidates: list[layout.Candidate]) -> list[layout.Candidate]:
    """``head`` and its ancestors (by the manifests' parent links), newest first."""
    by_name = {c.name: c for c in candidates}
    out, c = [], head
    while c is not None and c not in out:
        out.append(c)
        parent = (c.manifest or {}).get("parent")
        c = by_name.get(parent) if isinstance(parent, str) else None
    return out


class Fence:
    """The launch epochs under ``_epochs/`` of one root (``Catalog.fence``): which launch owns the
    root now, this launch's own (``epoch``, taken or joined by :meth:`acquire`), the check every
    commit, clean and delete makes first (:meth:`check`), and the base this launch's lineage
    starts from (:meth:`record_base`). ``lock``: the catalog's."""

    def __init__(self, storage: Storage, *, epoch: str | None, events: EventLog, lock: threading.RLock):
        self.storage = storage
        self.epoch = epoch
        self.events = events
        self._lock = lock

    def names(self) -> list[str]:
        """Epoch names (``NNNNNNNN-<launch>``), oldest first: one listing, no record read."""
        names = [
            rel.removesuffix(".json")
            for rel in self.storage.list_files(self.storage.join(EPOCHS))
            if rel.endswith(".json") and "/" not in rel
        ]
        return sorted(names, key=layout.epoch_key)

    def record(self, name: str) -> dict[str, Any]:
        """One epoch's record ({} when it is missing or not an object; ``unreadable`` when damaged)."""
        try:
            rec = read_json(self.storage, self.storage.join(EPOCHS, name + ".json"))
        except FileNotFoundError:
            return {}
        except (ValueError, OSError) as e:
            return {"unreadable": str(e)}
        return rec if isinstance(rec, dict) else {}

    def records(self) -> dict[str, dict[str, Any]]:
        """Epoch name -> its record, oldest first."""
        return {name: self.record(name) for name in self.names()}

    def current(self) -> str | None:
        names = self.names()
        return names[-1] if names else None

    def acquire(self, launch_id: str) -> str:
        """Take (or, for another node of the same launch, join) this launch's epoch. Never waits."""
        slug = _launch_slug(launch_id)
        with self._lock:
            current = self.current()
            if current is not None and current.partition("-")[2] == slug:
                self.epoch = current
                return current
            number = layout.epoch_key(current)[0] + 1 if current else 1
            name = f"{number:08d}-{slug}"
            write_json_atomic(
                self.storage,
                self.storage.join(EPOCHS, name + ".json"),
                {"launch": launch_id, "created": time.time(), "host": socket.gethostname(), "pid": os.getpid()},
            )
            self.epoch = name
            self.events.emit("checkpoint_epoch", epoch=name, previous=current)
            self.check()
            return name

    def check(self) -> None:
        """Raise FencedError when a newer launch has taken the root. No-op without an epoch."""
        if not self.epoch:
            return
        current = self.current()
        if current is not None and layout.epoch_key(current) > layout.epoch_key(self.epoch):
            raise FencedError(
                f"checkpoint root {self.storage.describe()} was taken over by a newer launch (epoch {current}); "
                f"this launch (epoch {self.epoch}) no longer commits, cleans or deletes there and stops"
            )

    def record_base(self, base: str | None) -> None:
        """Rank 0, first start of a launch: remember what this launch's lineage starts from."""
        if not self.epoch:
            return
        path = self.storage.join(EPOCHS, self.epoch + ".json")
        with self._lock:
            try:
                rec = read_json(self.storage, path)
            except (ValueError, OSError):
                rec = {}
            rec["base"] = base
            self.check()
            write_json_atomic(self.storage, path, rec)


class Quarantine:
    """The quarantine markers of one catalog's commits (``Catalog.quarantine``): :meth:`mark` a
    commit bad, :meth:`release` one whose bytes verify again. ``lock``: the catalog's."""

    def __init__(self, catalog: Catalog, *, lock: threading.RLock):
        self._catalog = catalog
        self._lock = lock

    def mark(self, name: str, reason: str) -> None:
        """Mark a committed checkpoint bad (a marker next to its manifest; nothing is deleted)."""
        cat = self._catalog
        with self._lock:
            write_json_atomic(
                cat.storage,
                cat.storage.join(name, layout.QUARANTINE),
                {"reason": reason[:2000], "time": time.time(), "epoch": cat.epoch or ""},
            )
        cat.events.emit("checkpoint_quarantined", step=layout.parse_step_dir(name), name=name, reason=reason[:2000])

    def release(self, name: str) -> dict[str, Any]:
        """Lift the quarantine of ``name`` after re-verifying it whole: the manifest's seal (and
        HMAC with a key), every file present at its size and every file's bytes against its
        XXH3. Raises CheckpointError naming the problem when the bytes are still bad (the marker
        stays). Returns the marker that was lifted."""
        from ..errors import CheckpointIntegrityError

        cat = self._catalog
        with self._lock:
            c = next((x for x in cat.scan() if x.name == name), None)
            if c is None or c.manifest is None:
                raise CheckpointError(f"{name}: no committed checkpoint of that name under {cat.storage.describe()}")
            if c.quarantine is None:
                raise CheckpointError(f"{name} is not quarantined")
            problem = layout.verify(layout.Candidate(c.step, c.name, c.manifest, c.files, None, c.writer), cat.key)
            if problem is None:
                for rel, f in sorted(c.manifest.get("files", {}).items()):
                    want = f.get("xxh3") if isinstance(f, dict) else None
                    if want is None:
                        continue
                    data = cat.storage.read_bytes(cat.storage.join(name, rel))
                    if layout.digest(data) != int(want):
                        problem = f"file {rel}: checksum mismatch (its bytes are still bad)"
                        break
            if problem:
                raise CheckpointIntegrityError(f"{name} stays quarantined: {problem}")
            cat.fence.check()
            cat.storage.delete_tree(cat.storage.join(name, layout.QUARANTINE))
        cat.events.emit("checkpoint_released", step=c.step, name=name, reason=c.quarantine.get("reason"))
        return c.quarantine


class Pruner:
    """What is deleted under one catalog's root (``Catalog.pruner``): older commits of the lineage
    past the retention (:meth:`retention`), and the uncommitted leftovers of crashed saves at
    start-up (:meth:`clean_uncommitted`, :meth:`clean_listed`). Every deletion is fenced first.
    ``lock``: the catalog's."""

    def __init__(self, catalog: Catalog, *, lock: threading.RLock):
        self._catalog = catalog
        self._lock = lock

    def retention(self, newest: str, keep_last: int, keep_every: int) -> list[int]:
        """After ``newest`` was committed: delete older commits *of its lineage* beyond
        ``keep_last`` (multiples of ``keep_every`` stay). Parked, quarantined and suspect ones
        stay, and so does the newest commit an audit certified."""
        cat = self._catalog
        with self._lock:
            candidates = cat.scan()
            by_name = {c.name: c for c in candidates}
            head = by_name.get(newest)
            if head is None or cat.problem(head) is not None:
                return []  # never delete anything unless the newer commit verifies
            chain = [c for c in lineage(head, candidates) if cat.problem(c) is None]
            protected = {head.step} | layout.retention_protected(chain, layout.suspect_reasons(candidates))
            victims = set(layout.retention_victims([c.step for c in chain], keep_last, keep_every, protected))
            deleted = []
            for c in chain:
                if c.step in victims:
                    cat.fence.check()
                    self._delete_commit(c)
                    deleted.append(c.step)
                    cat.events.emit("checkpoint_deleted", step=c.step, name=c.name, reason="retention")
            return deleted

    def _delete_commit(self, c: layout.Candidate) -> None:
        """Delete a commit as :meth:`Catalog.scan` listed it: its commit marker first, so a
        deletion cut short leaves an uncommitted leftover (cleaned at a start), never a commit
        with files missing; then the rest, without listing it again."""
        storage, d = self._catalog.storage, self._catalog.storage.join(c.name)
        storage.delete_files(d, [layout.MANIFEST])
        storage.delete_files(d, sorted({*c.files, *c.markers} - {layout.MANIFEST}))

    def clean_uncommitted(
        self, keep: frozenset[str] = frozenset(), candidates: list[layout.Candidate] | None = None
    ) -> list[layout.Candidate]:
        """Start-up only: delete uncommitted leftovers this epoch may delete (see layout), of
        ``candidates`` (this start's :meth:`Catalog.scan`; else scanned here). Fenced first."""
        cat = self._catalog
        with self._lock:
            cat.fence.check()
            cleaned = []
            for c in layout.cleanable_uncommitted(cat.scan() if candidates is None else candidates, cat.epoch or ""):
                if c.name not in keep:
                    self._remove_leftover(c.name)
                    cleaned.append(c)
            return cleaned

    def clean_listed(self, uncommitted: list[str]) -> list[str]:
        """Start-up only, from a listing (:meth:`Catalog.names`): delete the directories listed without a
        commit marker when this launch holds the newest epoch — no newer launch can be writing
        one, so no writer marker is read (what :func:`layout.cleanable_uncommitted` would
        allow). Fenced first. Returns the names deleted."""
        cat = self._catalog
        if not uncommitted or not cat.epoch:
            return []
        with self._lock:
            if cat.fence.current() != cat.epoch:
                cat.fence.check()  # raises when a newer launch holds the root
                return []  # our epoch record went missing: leave them to the verifying decision
            for name in uncommitted:
                self._remove_leftover(name)
            return list(uncommitted)

    def _remove_leftover(self, name: str) -> None:
        cat = self._catalog
        logger.info("removing uncommitted leftover %s", name)
        cat.storage.delete_tree(cat.storage.join(name))
        cat.events.emit("checkpoint_cleaned", step=layout.parse_step_dir(name), name=name, reason="uncommitted")
