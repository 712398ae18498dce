"""The local tier: per-rank copies of every save in node-local storage (``checkpoint.local_dir``).

Layout, under ``<local_dir>/<job>/`` (``job``: a hash of ``checkpoint.dir``, so two jobs that share
a node never see each other's copies)::

    <epoch>/step-XXXXXXXX/rank-R-of-W/   __0_0.distcp  .metadata  .checksums.json  manifest.json

Each rank writes its own shards as a DCP checkpoint of its part of the state, tensors as their raw
bytes, planned by DCP once per layout (:class:`~.integrity.RawCopier`), and then commits its
copy by itself: ``manifest.json`` (sealed, HMAC-signed with the checkpoint key when one is set)
is written last and names every file with the size and XXH3 DCP reported writing. A rank's copy
is *its* proof; whether a step is usable is agreed by every rank at load (:meth:`usable` on every
rank, then the manager takes the newest step every rank can prove). A copy is usable only:

* in the launch epoch that owns the checkpoint root now (a restart of the same launch: another
  launch's copies are stale by definition, and are deleted at load);
* for this rank, world size, mesh and model fingerprint;
* when it descends from the remote checkpoint the catalog chose (``remote_chain``: the remote
  saves its lineage went through), at that step or newer.

Retention keeps this rank's newest :data:`KEEP` committed copies; an older copy is retired only
after a newer one is committed. A retired copy is not deleted but kept as this rank's *spare*
(``<epoch>/.spare-rank-R-of-W/``, uncommitted: its manifest is removed first) and becomes the next
copy's directory, whose data file is then overwritten in place: rewriting pages the file already
has costs a fraction of allocating new ones (tmpfs zeroes every new page), and the memory held is
the peak a save reaches anyway (:data:`KEEP` copies and the one being written). The object store
stays the durable record: nothing here is needed for the guarantees of ``checkpoint.dir``, and
every doubt falls back to it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, cast

from ..storage.fs import open_storage
from . import integrity, layout

logger = logging.getLogger(__name__)

KEEP = 2  # committed copies per rank: the newest, and the one before in case a rank missed it
CHAIN_MAX = 32  # remote names remembered in a copy's lineage
_STEP_RE = re.compile(r"^step-(\d{8})$")


def job_key(ckpt_dir: str) -> str:
    """The directory of one job's copies: a hash of its checkpoint root."""
    return hashlib.sha256(ckpt_dir.rstrip("/").encode()).hexdigest()[:16]


def _slug(epoch: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", epoch or "no-epoch")[:120]


def copy_dir(root: str, epoch: str, step: int, rank: int, world_size: int) -> str:
    """The directory of rank ``rank`` of ``world_size``'s copy of ``step`` under a job's ``root``
    (:attr:`LocalTier.root`)."""
    return os.path.join(root, _slug(epoch), layout.step_dir_name(step), f"rank-{rank}-of-{world_size}")


@dataclass(frozen=True)
class Copy:
    """One committed, verified local copy of this rank."""

    step: int
    path: str  # the rank directory
    manifest: dict[str, Any]


class LocalTier:
    """This rank's copies in the local tier: writes them (:meth:`writer`, :meth:`commit`), finds
    the usable ones at load (:meth:`usable`, :meth:`reader`), and deletes the stale ones.

    ``local_dir``: ``checkpoint.local_dir``; ``ckpt_dir``: ``checkpoint.dir``, which names this
    job's directory under it; ``key``: the manifest signing key (None: unsigned). Runs no
    collective: which step every rank can load is agreed by the manager."""

    def __init__(self, local_dir: str, ckpt_dir: str, *, rank: int, world_size: int, key: bytes | None):
        self.root = os.path.join(os.path.abspath(local_dir), job_key(ckpt_dir))
        self.rank = rank
        self.world_size = world_size
        self.key = key
        self.storage = open_storage(self.root)

    # ------------------------------------------------------------------ naming
    def _epoch_dir(self, epoch: str) -> str:
        return os.path.join(self.root, _slug(epoch))

    def rank_dir(self, epoch: str, step: int) -> str:
        return copy_dir(self.root, epoch, step, self.rank, self.world_size)

    # ------------------------------------------------------------------ saving
    def _spare(self, epoch: str) -> str:
        return os.path.join(self._epoch_dir(epoch), f".spare-rank-{self.rank}-of-{self.world_size}")

    def prepare(self, epoch: str, step: int) -> str:
        """The directory of this rank's copy of ``step``, for :class:`~.integrity.RawCopier`: the
        spare (its data file alone, to be overwritten in place), else a new empty one; any
        earlier, unusable attempt at the same step is removed first."""
        d = self.rank_dir(epoch, step)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        spare = self._spare(epoch)
        try:
            for name in os.listdir(spare):
                if name != integrity.RAW_FILE:
                    os.remove(os.path.join(spare, name))
            os.rename(spare, d)
        except OSError:
            shutil.rmtree(spare, ignore_errors=True)
            os.makedirs(d, exist_ok=True)
        return d

    def abandon(self, epoch: str, step: int) -> None:
        """Remove this rank's attempt at ``step`` after it failed, unless it committed: a file
        system that filled up keeps no partial copies, so the next copy finds their room."""
        d = self.rank_dir(epoch, step)
        if not os.path.exists(os.path.join(d, layout.MANIFEST)):
            _remove(d)

    def _retire(self, epoch: str, d: str) -> None:
        """Retire this rank's committed copy ``d``: uncommitted first, then kept as the spare (or
        deleted when there is one)."""
        spare = self._spare(epoch)
        try:
            if os.path.exists(spare):
                raise FileExistsError(spare)
            os.remove(os.path.join(d, layout.MANIFEST))
            os.rename(d, spare)
            os.rmdir(os.path.dirname(d))  # its step directory, once no rank of this node uses it
        except OSError:
            _remove(d)

    def commit(
        self,
        epoch: str,
        step: int,
        *,
        mesh_shape: list[int],
        fingerprint: str,
        torch_version: str,
        extra: dict[str, Any],
        written: dict[str, dict[str, Any]],
    ) -> dict[str, Any]:
        """This rank's proof for its copy of ``step``: every file the copier reported ``written``
        (name -> size, XXH3, items) is there with that size; the sealed manifest is written last.
        Then retention. Raises on a problem."""
        d = self.rank_dir(epoch, step)
        listed = {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)}
        problem = layout.commit_problem(written, listed)
        if problem:
            raise OSError(f"local copy of step {step} incomplete: {problem}")
        manifest = layout.build_manifest(
            step=step,
            world_size=self.world_size,
            mesh_shape=mesh_shape,
            files=written,
            created=time.time(),
            torch_version=torch_version,
            fingerprint=fingerprint,
            epoch=epoch,
            extra={**extra, "rank": self.rank, "tier": "local"},
        )
        manifest, data = layout.sealed(manifest, self.key)
        self.storage.write_bytes_atomic(os.path.join(d, layout.MANIFEST), data)
        self._retain(epoch, step)
        return manifest

    def _steps(self, epoch: str) -> list[int]:
        try:
            names = os.listdir(self._epoch_dir(epoch))
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)) for n in names if (m := _STEP_RE.match(n))), reverse=True)

    def _retain(self, epoch: str, newest: int) -> None:
        """Keep this rank's KEEP newest committed copies (``newest`` among them); retire older
        copies (:meth:`_retire`), remove attempts older than ``newest`` that never committed, and,
        once KEEP are committed, the copies of another world size older than them and that world
        size's spares (from before a reshard)."""
        kept = 0
        for step in self._steps(epoch):
            d = self.rank_dir(epoch, step)
            committed = os.path.exists(os.path.join(d, layout.MANIFEST))
            if step > newest:
                continue  # an attempt of a newer step (not this rank's business now)
            if committed and kept < KEEP:
                kept += 1
                continue
            if kept == KEEP:
                self._drop_other_worlds(epoch, step)
            if committed:
                self._retire(epoch, d)
            else:
                _remove(d)
        if kept == KEEP:
            self._drop_other_spares(epoch)

    # ------------------------------------------------------------------ loading
    def usable(
        self, epoch: str, *, min_step: int, remote: str | None, mesh_shape: list[int], fingerprint: str
    ) -> tuple[list[Copy], str]:
        """This rank's usable copies, newest first, and why none when the list is empty."""
        copies: list[Copy] = []
        why = f"no local copy at or after step {min_step}"
        for step in self._steps(epoch):
            if step < min_step:
                break
            d = self.rank_dir(epoch, step)
            problem = self._problem(d, step, remote, mesh_shape, fingerprint)
            if problem is None:
                # verified just above (read again: a copy deleted in between would leave None here)
                copies.append(Copy(step, d, cast(dict[str, Any], self._manifest(d))))
            elif not copies:
                why = f"local copy of step {step}: {problem}"
        return copies, why

    def _manifest(self, d: str) -> dict[str, Any] | None:
        try:
            with open(os.path.join(d, layout.MANIFEST)) as f:
                m = json.load(f)
            return m if isinstance(m, dict) else {"unreadable": "not an object"}
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            return {"unreadable": f"{type(e).__name__}: {e}"}

    def _problem(self, d: str, step: int, remote: str | None, mesh_shape: list[int], fingerprint: str) -> str | None:
        try:
            files = {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)}
        except FileNotFoundError:
            return "missing on this rank"
        m = self._manifest(d)
        problem = layout.verify(layout.Candidate(step, layout.step_dir_name(step), m, files), self.key)
        if problem:
            return problem
        assert m is not None  # layout.verify refuses a missing manifest
        if m.get("rank") != self.rank or m.get("world_size") != self.world_size or m.get("mesh_shape") != mesh_shape:
            return (
                f"written by rank {m.get('rank')} of {m.get('world_size')} (mesh {m.get('mesh_shape')}), not this rank"
            )
        if m.get("config_fingerprint") != fingerprint:
            return "written for another model"
        if (remote or "") not in (m.get("remote_chain") or []):
            return f"does not descend from the remote checkpoint chosen ({remote or 'none'})"
        return None

    def reader(self, copy: Copy):
        """A DCP reader of ``copy`` that verifies every byte it reads against its manifest."""
        return integrity.verifying(self.storage.dcp.reader(copy.path), layout.Checks.from_manifest(copy.manifest))

    # ------------------------------------------------------------------ housekeeping
    def discard(self, copy: Copy) -> None:
        """Drop a copy that failed to load on this rank (it is never chosen again)."""
        _remove(copy.path)

    def copies_on_disk(self, epoch: str) -> list[str]:
        """This rank's copy directories of ``epoch``, newest first (fault injection)."""
        return [d for step in self._steps(epoch) if os.path.isdir(d := self.rank_dir(epoch, step))]

    def purge_other_epochs(self, epoch: str) -> None:
        """Remove copies of other launches of this job (never usable again)."""
        keep = _slug(epoch)
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for n in names:
            if n != keep:
                shutil.rmtree(os.path.join(self.root, n), ignore_errors=True)

    def drop_epoch(self, epoch: str) -> None:
        """This rank's copies of ``epoch`` (the run finished: no restart of this launch needs them),
        and any of another world size."""
        for step in self._steps(epoch):
            self._drop_other_worlds(epoch, step)
            _remove(self.rank_dir(epoch, step))
        shutil.rmtree(self._spare(epoch), ignore_errors=True)
        self._drop_other_spares(epoch)

    def _drop_other_spares(self, epoch: str) -> None:
        """The spares of another world size than this one (from before a reshard)."""
        try:
            names = os.listdir(self._epoch_dir(epoch))
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith(".spare-rank-") and not name.endswith(f"-of-{self.world_size}"):
                shutil.rmtree(os.path.join(self._epoch_dir(epoch), name), ignore_errors=True)

    def _drop_other_worlds(self, epoch: str, step: int) -> None:
        base = os.path.dirname(self.rank_dir(epoch, step))
        try:
            names = os.listdir(base)
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith("rank-") and not name.endswith(f"-of-{self.world_size}"):
                _remove(os.path.join(base, name))


def _remove(rank_dir: str) -> None:
    """Delete one rank's copy, and its step directory once no rank of this node uses it."""
    shutil.rmtree(rank_dir, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(rank_dir))
    except OSError:
        pass
