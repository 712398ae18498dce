"""Pure functions: checkpoint naming, manifests, verification, selection and retention. No I/O.

A checkpoint is a directory ``step-XXXXXXXX/`` (or ``step-XXXXXXXX.G/`` when that step's name
is already taken by an older, abandoned or quarantined directory: committed directories are never
rewritten) under the checkpoint root. It counts (is *committed*) only when its
``manifest.json`` exists. Rank 0 writes the manifest after DCP's final gather, from what DCP
reported writing: every file with its size and XXH3 checksum and the checksum of every item, checked
against the storage listing. A committed checkpoint is *valid* when its manifest seals
(self-checksum; HMAC too when a key is set), it is not quarantined, and every listed file exists
with exactly the listed size. Names starting with ``_`` under the root are reserved
(``_epochs/``, ``_events/``, ...) and never taken for checkpoints.

``ckpt audit`` records its verdict on a commit in ``audit.json`` beside the manifest (the
commit's own files are never rewritten): ``certified`` (a replay from an earlier commit gave the
same bytes) or ``suspect`` (it did not: silent data corruption). A resume never loads a suspect
commit nor one that descends from it (:func:`suspect_reasons`); they are kept, never quarantined.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .. import contract
from ..heap import collector_paused

MANIFEST = "manifest.json"
QUARANTINE = "quarantine.json"
WRITER = ".writer.json"
AUDIT = "audit.json"  # ``ckpt audit``'s verdict on the commit (its sidecar)
CERTIFIED, SUSPECT = "certified", "suspect"
CHECKSUMS = ".checksums.json"  # DCP's writer's table of every file and item it wrote (see integrity)
MARKERS = (MANIFEST, QUARANTINE, WRITER, CHECKSUMS, AUDIT)  # a directory's files that are not DCP's
METADATA = ".metadata"  # DCP's own metadata file
MANIFEST_VERSION = 2  # the format this version writes
READABLE_VERSIONS = (2,)  # the formats this version reads; any other stops a resume (exit 2) naming both
RESERVED_PREFIX = "_"
_STEP_RE = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")
_SEAL_KEYS = ("checksum", "hmac")


def step_dir_name(step: int, gen: int = 0) -> str:
    return f"step-{step:08d}" + (f".{gen}" if gen else "")


def parse_dir(name: str) -> tuple[int, int] | None:
    """(step, generation) of a checkpoint directory name, None for anything else."""
    m = _STEP_RE.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def parse_step_dir(name: str) -> int | None:
    p = parse_dir(name)
    return p[0] if p else None


def next_dir_name(step: int, taken: Collection[str]) -> str:
    """The directory a new save of ``step`` writes to: the plain name unless some directory
    (committed, quarantined or leftover) already has it. Pure, so every rank computes the same."""
    gen = 0
    while step_dir_name(step, gen) in taken:
        gen += 1
    return step_dir_name(step, gen)


def is_reserved(name: str) -> bool:
    return name.startswith(RESERVED_PREFIX)


@dataclass(frozen=True)
class Candidate:
    """What discovery saw of one ``step-*`` directory."""

    step: int
    name: str
    manifest: dict[str, Any] | None  # None: uncommitted
    files: dict[str, int]  # relative name -> size, as listed in storage
    quarantine: dict[str, Any] | None = None
    writer: dict[str, Any] | None = None  # who wrote an uncommitted directory (epoch)
    audit: dict[str, Any] | None = None  # ``ckpt audit``'s verdict (AUDIT), if audited
    markers: tuple[str, ...] = ()  # the marker files listed beside ``files`` (MARKERS)

    @property
    def gen(self) -> int:
        p = parse_dir(self.name)
        return p[1] if p else 0

    @property
    def verdict(self) -> str | None:
        """``certified``, ``suspect`` or None (not audited, or a verdict on other bytes)."""
        a = self.audit or {}
        if a.get("verdict") not in (CERTIFIED, SUSPECT):
            return None
        sealed_by = (self.manifest or {}).get("checksum")
        return a["verdict"] if a.get("manifest_checksum") == sealed_by else None


# ------------------------------------------------------------------------------- manifests
def _canonical(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k not in _SEAL_KEYS}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: dict[str, Any], key: bytes | None) -> dict[str, Any]:
    """The manifest with its self-checksum (catches corruption of the manifest itself) and, when
    ``key`` is given, an HMAC-SHA256 over the same bytes (catches forgery)."""
    return sealed(manifest, key)[0]


def sealed(manifest: dict[str, Any], key: bytes | None) -> tuple[dict[str, Any], bytes]:
    """:func:`seal`, and the sealed manifest as JSON: the canonical bytes the seal is computed
    over with the seal's keys added, so a manifest is encoded once (the local tier commits one
    at every save)."""
    out = {k: v for k, v in manifest.items() if k not in _SEAL_KEYS}
    data = _canonical(out)
    marks = {"checksum": hashlib.sha256(data).hexdigest()}
    if key:
        marks["hmac"] = hmac.new(key, data, hashlib.sha256).hexdigest()
    out.update(marks)
    tail = json.dumps(marks, sort_keys=True, separators=(",", ":")).encode()
    return out, (data[:-1] + b"," + tail[1:]) if out.keys() - marks.keys() else tail


def seal_problem(manifest: dict[str, Any], key: bytes | None) -> str | None:
    """None when the manifest's seal holds, else why not."""
    data = _canonical(manifest)
    if manifest.get("checksum") != hashlib.sha256(data).hexdigest():
        return "manifest checksum mismatch (corrupted manifest)"
    if key:
        mac = manifest.get("hmac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, hmac.new(key, data, hashlib.sha256).hexdigest()):
            return (
                f"manifest signature does not verify with {contract.CHECKPOINT_KEY_ENV} (unsigned or tampered): refused"
            )
    return None


def is_corruption(reason: str) -> bool:
    """Whether a :func:`verify` reason is about the manifest's *content* (unreadable, broken
    seal or signature): deterministic, so worth a quarantine marker. Missing or short files may be
    a listing that has not caught up yet, and are re-checked at every start instead."""
    return reason.startswith(("manifest unreadable", "manifest checksum mismatch", "manifest signature"))


FORMAT_PROBLEM = "checkpoint format version"


def format_problem(manifest: dict[str, Any]) -> str | None:
    """None when this version reads the manifest's format, else why not (naming both versions)."""
    version = manifest.get("version")
    if version in READABLE_VERSIONS:
        return None
    newer = isinstance(version, int) and version > max(READABLE_VERSIONS)
    return (
        f"{FORMAT_PROBLEM} {version!r}: this elastic_trainer reads format {', '.join(map(str, READABLE_VERSIONS))}"
        + (
            " (written by a newer elastic_trainer: upgrade to resume it)"
            if newer
            else " (written by an older elastic_trainer that this one no longer reads)"
        )
    )


def is_format_problem(reason: str) -> bool:
    """Whether a :func:`verify` reason is an unreadable format: an incompatibility, not damage."""
    return reason.startswith(FORMAT_PROBLEM)


def build_manifest(
    *,
    step: int,
    world_size: int,
    mesh_shape: list[int],
    files: dict[str, dict[str, Any]],
    created: float,
    torch_version: str,
    fingerprint: str,
    epoch: str = "",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``files``: relative name -> {"size", "xxh3", "items": [[offset, length, xxh3], ...]}."""
    return {
        "version": MANIFEST_VERSION,
        "step": step,
        "world_size": world_size,
        "mesh_shape": mesh_shape,
        "time": created,
        "files": dict(sorted(files.items())),
        "total_bytes": sum(int(f["size"]) for f in files.values()),
        "torch_version": torch_version,
        "config_fingerprint": fingerprint,
        "epoch": epoch,
        **(extra or {}),
    }


def file_sizes(manifest: dict[str, Any]) -> dict[str, int]:
    files = manifest.get("files")
    if not isinstance(files, dict):
        return {}
    return {k: int(v["size"]) if isinstance(v, dict) else int(v) for k, v in files.items()}


def commit_problem(expected: dict[str, dict[str, Any]], listed: dict[str, int]) -> str | None:
    """Why a save cannot be committed: a file DCP reported writing is absent or of another size
    in storage (e.g. another node's shard in a directory that is not shared). Pure."""
    if ".metadata" not in expected:
        return "no .metadata among the written files"
    for rel, f in sorted(expected.items()):
        if rel not in listed:
            return f"file {rel} (written by DCP) is missing from storage"
        if listed[rel] != int(f["size"]):
            return f"file {rel} has {listed[rel]} bytes in storage, {f['size']} were written"
    return None


def verify(c: Candidate, key: bytes | None = None) -> str | None:
    """None when ``c`` is committed, sealed, not quarantined and complete, else why it is unusable."""
    if c.manifest is None:
        return "uncommitted (no manifest)"
    if "unreadable" in c.manifest:
        if c.manifest.get("read_failed"):  # not damage (is_corruption): re-read at the next start
            return f"manifest could not be read: {c.manifest['unreadable']}"
        return f"manifest unreadable: {c.manifest['unreadable']}"
    if c.quarantine is not None:
        return f"quarantined: {c.quarantine.get('reason', 'unknown reason')}"
    problem = format_problem(c.manifest)
    if problem:
        return problem
    problem = seal_problem(c.manifest, key)
    if problem:
        return problem
    if c.manifest.get("step") != c.step:
        return f"manifest step {c.manifest.get('step')} does not match directory {c.name}"
    expected = file_sizes(c.manifest)
    if not expected or ".metadata" not in expected:
        return "manifest lists no files"
    for rel, size in sorted(expected.items()):
        if rel not in c.files:
            return f"file {rel} is missing"
        if c.files[rel] != size:
            return f"file {rel} has {c.files[rel]} bytes, manifest says {size}"
    return None


# ------------------------------------------------------------------------------- audit verdicts
SUSPECT_REASON = "suspect"


def is_suspect_reason(reason: str) -> bool:
    """Whether a resume skipped a commit (``Selection.skipped``) for an audit's verdict."""
    return reason.startswith(SUSPECT_REASON)


def suspect_reasons(candidates: list[Candidate]) -> dict[str, str]:
    """Name -> why a resume must not load it, for every commit an audit found suspect and every
    commit that descends from one (by the manifests' parent links). Pure."""
    by_name = {c.name: c for c in candidates}
    out: dict[str, str] = {}
    for c in candidates:
        seen: set[str] = set()
        x: Candidate | None = c
        while x is not None and x.name not in seen:
            seen.add(x.name)
            if x.verdict == SUSPECT:
                a = x.audit or {}
                where = f"rank {a.get('rank')}, tensor {a.get('tensor')}" if a.get("rank") is not None else "audited"
                out[c.name] = (
                    f"{SUSPECT_REASON}: silent data corruption found by ckpt audit ({where})"
                    if x is c
                    else f"{SUSPECT_REASON}: descends from suspect checkpoint {x.name}"
                )
                break
            parent = (x.manifest or {}).get("parent")
            x = by_name.get(parent) if isinstance(parent, str) else None
    return out


UNCERTIFIED_REASON = "not certified (checkpoint.resume_certified_only)"


def uncertified_reasons(candidates: list[Candidate]) -> dict[str, str]:
    """Name -> why ``checkpoint.resume_certified_only`` passes it over, for every commit
    ``ckpt audit`` has not certified (kept; an audit that certifies it makes it loadable). Pure."""
    return {
        c.name: f"{UNCERTIFIED_REASON}: audit it with `elastic-trainer ckpt audit`"
        for c in candidates
        if c.manifest is not None and c.verdict != CERTIFIED
    }


def retention_protected(chain: list[Candidate], suspects: Collection[str]) -> set[int]:
    """Steps of ``chain`` (a lineage, newest first) retention keeps whatever ``keep_last``
    says: the newest certified commit and every suspect one (evidence). Pure."""
    keep = {c.step for c in chain if c.name in suspects}
    certified = [c.step for c in chain if c.verdict == CERTIFIED]
    return keep | set(certified[:1])


# ------------------------------------------------------------------------------- decisions
@dataclass
class Selection:
    chosen: Candidate | None
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (step, reason), newest first


def _order(c: Candidate) -> tuple[int, int]:
    return (c.step, c.gen)


def select_for_resume(
    candidates: list[Candidate], resume: str, key: bytes | None = None, exclude: frozenset[str] = frozenset()
) -> Selection:
    """Pick the checkpoint to resume from.

    ``resume == "none"`` → nothing. ``"latest"`` → the newest valid one, falling back past
    invalid ones (each recorded in ``skipped``). A step number → the newest valid directory of
    exactly that step, or nothing with the reason in ``skipped`` (the caller turns that into an
    error). Directories named in ``exclude`` (failed to load in this start) are skipped silently;
    suspect ones and their descendants (:func:`suspect_reasons`) are skipped with the reason.
    """
    suspects = suspect_reasons(candidates)
    sel = Selection(None)
    if resume == "none":
        return sel
    ordered = sorted((c for c in candidates if c.name not in exclude), key=_order, reverse=True)
    if resume != "latest":
        want = int(resume)
        ordered = [c for c in ordered if c.step == want]
        if not ordered:
            sel.skipped.append((want, "no such checkpoint"))
            return sel
    for c in ordered:
        reason = suspects.get(c.name) or verify(c, key)
        if reason is None:
            sel.chosen = c
            return sel
        sel.skipped.append((c.step, reason))
    return sel


def retention_victims(
    committed_steps: list[int], keep_last: int, keep_every: int, protected: Collection[int] = frozenset()
) -> list[int]:
    """Committed steps to delete: all but the newest ``keep_last``, except multiples of
    ``keep_every`` (when > 0) and ``protected`` steps (e.g. the one resumed from)."""
    ordered = sorted(set(committed_steps), reverse=True)
    keep = set(ordered[:keep_last]) | set(protected)
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    return sorted(s for s in ordered if s not in keep)


def epoch_key(name: str) -> tuple[int, str]:
    """Order of epoch names ``NNNNNNNN-<launch id>``: the number, then the id (a tie between two
    launches that raced for the same number is broken the same way by everyone)."""
    num, _, rest = name.partition("-")
    return (int(num) if num.isdigit() else -1, rest)


def cleanable_uncommitted(candidates: list[Candidate], epoch: str) -> list[Candidate]:
    """Leftovers that epoch ``epoch`` may delete: uncommitted directories written by this epoch
    (an earlier incarnation of this launch) or by a superseded one (or by nobody known). Only
    called at start-up, before this incarnation's first save."""
    mine = epoch_key(epoch)
    out = []
    for c in candidates:
        if c.manifest is not None:
            continue
        writer = (c.writer or {}).get("epoch")
        if not writer or epoch_key(str(writer)) <= mine:
            out.append(c)
    return out


def compare_shapes(
    saved: dict[str, tuple[int, ...]], ours: dict[str, tuple[int, ...]], step: int
) -> tuple[str, str] | None:
    """First difference between checkpoint and model tensors."""
    for k in sorted(ours):
        if k not in saved:
            return (
                k,
                f"the model has {k} {list(ours[k])} but the checkpoint "
                f"of step {step} does not (different architecture)",
            )
        if saved[k] != ours[k]:
            return (
                k,
                f"shape {list(saved[k])} in the checkpoint of step {step}, "
                f"{list(ours[k])} in the model (different architecture)",
            )
    extra = sorted(k for k in saved if k.startswith("model.") and k not in ours)
    if extra:
        return extra[
            0
        ], f"the checkpoint of step {step} has {extra[0]}, which the model does not (different architecture)"
    return None


def digest(data) -> int:
    """XXH3-64 of ``data`` (any buffer): the checksum of every file and item a checkpoint lists."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class Checks:
    """What a reader verifies, from a verified manifest. Empty ``items`` = legacy (sizes only)."""

    metadata: tuple[int, int] | None  # (size, xxh3) of .metadata
    items: dict[tuple[str, int], tuple[int, int]]  # (file, offset) -> (length, xxh3)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> Checks:
        files = manifest.get("files") or {}
        meta = files.get(METADATA) or {}
        items = {}
        with collector_paused():  # one entry per item of every rank: 65,000 at 4,096 ranks
            for rel, f in files.items():
                for off, length, h in (f.get("items") or []) if isinstance(f, dict) else []:
                    items[(rel, int(off))] = (int(length), int(h))
        metadata = (int(meta["size"]), int(meta["xxh3"])) if isinstance(meta, dict) and "xxh3" in meta else None
        return cls(metadata, items)
