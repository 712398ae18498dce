"""``elastic-trainer ckpt audit ROOT --from A --to B``: find silent data corruption in a run's commits.

The project's promise is that a resume at the same world size is bitwise identical to an
uninterrupted run. An audit uses it as a test: it replays the run's steps A→B — the built-in
trainer's, or a script's under ``elastic-trainer run`` (its command is in the manifests) — from
commit A, at commit A's world size, on this machine, in a scratch directory (nothing is written
under ROOT but the verdicts), with the configuration the commits record and no fault injection;
the replay saves at every commit of the range. Each commit of the range (along the lineage of B)
is then compared with the replay's: the per-file checksums the manifests keep first, and where a
rank's shard differs, the tensors, to name the rank and tensor that differ most (a flipped bit
spreads to every rank within a step, through the gradients; the rank it happened on holds the
largest difference). Equal: ``certified``; different: ``suspect``. Each verdict goes beside its
commit (``audit.json``, :func:`record_verdict`); a resume never loads a suspect commit
nor one descending from it (:func:`.layout.suspect_reasons`).

Steps ran under the configuration of the launch that committed them, so a range that spans a
relaunch with other model, data or train settings (``train.steps=N`` to train longer changes
the schedule) is replayed in segments, each from the commit before it with its own settings.

Decisions are pure (:func:`audit_chain`, :func:`replay_segments`, :func:`replay_config`,
:func:`differing_files`, :func:`locate`); :func:`audit` reads, launches and records.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import contract
from ..config import check_uri, config_from_dict, toml_text
from ..errors import CheckpointError, ConfigError
from ..events import EventLog
from ..storage.fs import Storage, open_storage, write_json_atomic
from . import layout
from .catalog import Catalog, lineage

logger = logging.getLogger(__name__)

_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
REPLAY_LOG = "replay.log"  # in the scratch directory: the replay launch's output


@dataclass(frozen=True)
class Verdict:
    """One audited commit: ``name`` at ``step`` against a replay from ``from_step`` that took
    ``seconds``; a suspect one names the ``rank``, its ``node`` and the ``tensor`` that differ
    most, or the suspect step it ``descends_from`` (a later segment, not replayed)."""

    step: int
    name: str
    from_step: int
    suspect: bool
    rank: int | None = None
    node: int | None = None
    tensor: str | None = None
    descends_from: int | None = None
    seconds: float = 0.0
    replays: int = 1  # 2: a second replay broke the tie (:func:`tie_break`)
    objects: tuple[str, ...] = ()  # certified: the objects (not tensors) that differed, bookkeeping

    def line(self) -> str:
        """What ``ckpt audit`` prints for it."""
        if not self.suspect:
            return f"step {self.step} certified"
        if self.descends_from is not None:
            return f"step {self.step} suspect: descends from suspect step {self.descends_from}"
        return f"step {self.step} suspect: rank {self.rank} (node {self.node}), first tensor {self.tensor}"

    def event_fields(self) -> dict[str, Any]:
        """The fields of its ``checkpoint_audited`` event."""
        out: dict[str, Any] = {
            "step": self.step,
            "name": self.name,
            "from_step": self.from_step,
            "verdict": layout.SUSPECT if self.suspect else layout.CERTIFIED,
            "seconds": self.seconds,
            "replays": self.replays,
        }
        if self.objects:
            out["objects"] = list(self.objects)
        if self.descends_from is not None:
            out["descends_from"] = self.descends_from
        elif self.suspect:
            out.update(rank=self.rank, node=self.node, tensor=self.tensor)
        return out

    def record(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """The sidecar (``audit.json``) of this verdict on the commit whose manifest is ``manifest``."""
        fields = self.event_fields()
        fields.pop("name")
        fields["replay_seconds"] = fields.pop("seconds")
        return {**fields, "manifest_checksum": manifest.get("checksum"), "time": time.time()}


# ------------------------------------------------------------------------------- pure decisions
def audit_chain(candidates: list[layout.Candidate], first: int, last: int, key: bytes | None) -> list[layout.Candidate]:
    """The commits an audit of ``first``→``last`` judges, oldest first: the newest valid commit of
    step ``last`` and its ancestors back to step ``first`` (which it replays from; 0: the run's
    start, :data:`START`, at the world size of its first commit). Raises ConfigError naming
    ``--from``/``--to`` when a step is not a valid commit, ``first`` is not below ``last`` or not
    an ancestor of ``last``, or the world size changes in between."""
    if first >= last or first < 0:
        raise ConfigError("--from", f"{first} must be 0 (the run's start) or a commit below --to ({last})")
    valid = [c for c in candidates if layout.verify(c, key) is None]
    steps = ", ".join(map(str, sorted({c.step for c in valid}))) or "none"
    for flag, step in (("--from", first), ("--to", last)):
        if (step or flag == "--to") and not any(c.step == step for c in valid):
            raise ConfigError(flag, f"step {step} is not a valid commit under ROOT (valid commits: {steps})")
    head = max((c for c in valid if c.step == last), key=lambda c: c.gen)
    chain = [c for c in lineage(head, candidates) if c.step >= first]
    if not first:
        chain.append(dataclasses.replace(START, manifest={"world_size": (chain[-1].manifest or {}).get("world_size")}))
    if chain[-1].step != first or any(layout.verify(c, key) for c in chain if c.name):
        raise ConfigError("--from", f"step {first} is not an ancestor of the commit of step {last} ({head.name})")
    chain.reverse()
    for prev, c in zip(chain, chain[1:], strict=False):
        worlds = [(x.manifest or {}).get("world_size") for x in (prev, c)]
        if worlds[0] != worlds[1]:
            raise ConfigError(
                "--to",
                f"the world size changed from {worlds[0]} (step {prev.step}) to {worlds[1]} (step {c.step}): "
                f"a replay runs at one world size; audit up to step {prev.step}, and from step {c.step} on",
            )
    return chain


_COMPUTATION = ("model", "data", "train")  # the sections that fix what a step computes
START = layout.Candidate(0, "", {}, {})  # ``--from 0``: the run's start (no commit: a fresh start)


def replay_segments(chain: list[layout.Candidate]) -> list[tuple[layout.Candidate, list[layout.Candidate]]]:
    """``chain`` (:func:`audit_chain`) cut into replays: (the commit one starts from, the commits
    it judges). Steps up to a commit ran under the configuration that commit records (its
    launch's); where the model, data or train settings or a script's command line change (a
    relaunch with another ``train.steps``, say), the next replay starts from the commit before,
    with the new settings.
    Raises ConfigError naming a commit that records no configuration."""
    out: list[tuple[layout.Candidate, list[layout.Candidate]]] = []
    for prev, c in zip(chain, chain[1:], strict=False):
        if out and _computation(out[-1][1][-1]) == _computation(c):
            out[-1][1].append(c)
        else:
            out.append((prev, [c]))
    return out


def _computation(c: layout.Candidate) -> dict[str, Any]:
    """What fixes the steps up to commit ``c``: its launch's model, data and train settings and,
    for a script, its command line."""
    return {**{k: _config(c).get(k) for k in _COMPUTATION}, "command": (c.manifest or {}).get("command")}


# what a replay's config changes (every other key is the run's own)
_REPLAY_KEYS = frozenset(
    {"run.dir", "metrics.port", "model.init_from"}
    | {f"checkpoint.{k}" for k in ("dir", "resume", "interval_steps", "interval_seconds", "keep_last")}
    | {f"checkpoint.{k}" for k in ("keep_every", "local_dir", "allow_changes")}
    | {f"elastic.{k}" for k in ("nnodes", "nproc_per_node", "max_restarts", "rdzv_endpoint")}
)


def replay_config(
    recorded: Mapping[str, Any],
    scratch: str,
    base: layout.Candidate,
    saves: list[int],
    only: list[str] | None = None,
) -> dict:
    """The config of a replay from ``base`` (its world size, on this machine) that commits
    ``saves`` into ``scratch``: the run's own ``recorded`` config with only where it writes,
    how many processes on how many nodes, the save cadence and the resume changed. ``only``
    (a script's run): the keys its command line set; the others are left to the script's own
    settings, as they were (its global batch from its loader, say)."""
    cfg = _replay_changes({k: dict(v) for k, v in recorded.items()}, scratch, base, saves)
    if only is None:
        return cfg
    keep = _REPLAY_KEYS | set(only)
    return {s: {k: v for k, v in values.items() if f"{s}.{k}" in keep} for s, values in cfg.items()}


def _replay_changes(cfg: dict[str, Any], scratch: str, base: layout.Candidate, saves: list[int]) -> dict:
    assert base.manifest is not None  # a verified commit
    run, ckpt, data, el = cfg["run"], cfg["checkpoint"], cfg["data"], cfg["elastic"]
    if not data.get("cache_dir"):
        data["cache_dir"] = os.path.join(str(run["dir"]), "data-cache")  # the run's own packed text
    run["dir"] = os.path.join(scratch, "run")
    gap = math.gcd(*saves)
    ckpt.update(
        dir=os.path.join(scratch, "checkpoints"),
        resume=str(base.step) if base.name else "latest",  # the start: nothing to resume in the scratch root
        interval_steps=gap,
        interval_seconds=0.0,
        keep_last=max(1, (saves[-1] - base.step) // gap + 1),
        keep_every=0,
        local_dir="",
    )
    if base.name and cfg["model"].get("init_from"):  # the replay loads commit A, never the first weights
        cfg["model"]["init_from"] = ""
        ckpt["allow_changes"] = [*ckpt.get("allow_changes", []), "model.init_from"]
    el.update(nnodes="1", nproc_per_node=int(base.manifest["world_size"]), max_restarts=0, rdzv_endpoint="")
    cfg["metrics"] = {**cfg.get("metrics", {}), "port": 0}
    return cfg


def differing_files(ours: Mapping[str, Any], replayed: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(rank, file) of every rank's shard whose checksum differs between two manifests of the
    same step and world size (``.metadata`` names paths, so it is never compared), by rank."""
    theirs = replayed.get("files") or {}
    out = []
    for rel, f in sorted((ours.get("files") or {}).items()):
        m = _SHARD.match(rel)
        if m is None:
            continue
        other = theirs.get(rel)
        if not isinstance(other, dict) or other.get("xxh3") != f.get("xxh3") or other.get("size") != f.get("size"):
            out.append((int(m.group(1)), rel))
    extra = sorted(set(theirs) - set(ours.get("files") or {}))
    out += [(int(m.group(1)), rel) for rel in extra if (m := _SHARD.match(rel))]
    return sorted(out)


def tie_break(first: list[Verdict], second: list[Verdict]) -> list[Verdict]:
    """The verdicts of two replays of one segment, commit by commit: a commit either replay
    reproduced is certified (the other replay computed wrong: the audit's own machine); one
    neither reproduced stays suspect, where the first replay located it."""
    out = []
    for a, b in zip(first, second, strict=True):
        chosen = b if a.suspect and not b.suspect else a
        out.append(dataclasses.replace(chosen, replays=2, seconds=round(a.seconds + b.seconds, 3)))
    return out


def locate(scores: Mapping[tuple[int, str], float]) -> tuple[int, str]:
    """(rank, tensor) with the largest difference (``scores``: the largest absolute difference of
    each differing tensor, relative to its size); ties go to the lowest rank."""
    return min(scores, key=lambda k: (-scores[k], k[0], k[1]))


# ------------------------------------------------------------------------------- reading
def _items(metadata: Any) -> dict[str, list[tuple[int, int, str]]]:
    """File -> its items (offset, length, fully qualified name), by offset, from DCP metadata."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        out.setdefault(info.relative_path, []).append((int(info.offset), int(info.length), index.fqn))
    return {k: sorted(v) for k, v in out.items()}


def _tensor(data: bytes) -> Any:
    import torch

    try:
        t = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - not a tensor item (a pickled object): compared by bytes only
        return None
    return t if isinstance(t, torch.Tensor) else None


def _score(a: bytes, b: bytes) -> float | None:
    """How much item ``a`` differs from ``b``: the largest absolute difference of their tensors over
    the root mean square of ``b`` (infinite for another shape); None for an item that is not a
    tensor (a pickled object: a framework's bookkeeping, which may hold wall-clock times)."""
    ta, tb = _tensor(a), _tensor(b)
    if ta is None or tb is None:
        return None
    if ta.shape != tb.shape:
        return math.inf
    d = (ta.double() - tb.double()).abs().max().item() if ta.numel() else 0.0
    rms = tb.double().pow(2).mean().sqrt().item() if tb.numel() else 0.0
    return d / rms if rms > 0 else d


def _scores(ours: bytes, replayed: bytes, items: list[tuple[int, int, str]]) -> dict[str, float | None]:
    """Item -> score (:func:`_score`; None: an object) of every item whose bytes differ, for one rank's shard."""
    out: dict[str, float | None] = {}
    for off, length, fqn in items:
        a, b = ours[off : off + length], replayed[off : off + length]
        if a != b:
            score = _score(a, b)
            out[fqn] = score if score is None else max(out.get(fqn) or 0.0, score)
    return out


# ------------------------------------------------------------------------------- the audit
Replay = Callable[[list[str], dict[str, str], str, str | None], int]


def _launch(argv: list[str], env: dict[str, str], log: str, cwd: str | None) -> int:
    """Run the replay's ``elastic-trainer launch`` (or ``run``) to its end in ``cwd``, its output in ``log``."""
    with open(log, "ab") as out:
        return subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, check=False).returncode


def replay_command(manifest: Mapping[str, Any], config_path: str) -> tuple[list[str], str | None, list[str] | None]:
    """(argv, working directory, the keys its config sets: :func:`replay_config`'s ``only``) of
    the replay of the run that wrote ``manifest``, with the replay's config at ``config_path``: the
    built-in trainer's ``launch`` (also for a manifest that records no command: written before
    they did), or, for a script under ``run``, ``run`` of the same script and arguments in the
    same directory with the keys its command line set. ConfigError (exit 2) for a script another
    launcher started, or when its directory is not on this machine."""
    cli = [sys.executable, "-m", "elastic_trainer.cli"]
    command = manifest.get("command")
    entry = command.get("entry") if isinstance(command, dict) else "launch"  # older manifests: the trainer's
    if entry == "launch":
        return [*cli, "launch", config_path], None, None
    if entry != "run" or not isinstance(command, dict):
        raise ConfigError(
            "--to",
            f"the run was started by another launcher ({entry!r}: torchrun, accelerate launch, python), which "
            "an audit cannot start again: run the script under `elastic-trainer run` to audit its commits",
        )
    cwd = str(command.get("cwd") or "")
    if not os.path.isdir(cwd):
        raise ConfigError("--to", f"the run's script ran in {cwd!r}, which is not a directory here: audit there")
    argv = [*cli, "run", "--config", config_path, *map(str, command.get("argv") or [])]
    return argv, cwd, [str(k) for k in command.get("set") or []]


def _replay_env(stop: int) -> dict[str, str]:
    """This process's environment for the replay: no fault injection, no torchrun options from
    the environment, and the step to stop at."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != contract.INJECT_FAULT_ENV and not k.startswith(contract.TORCHRUN_ENV_PREFIX)
    }
    env[contract.REPLAY_TO_STEP_ENV] = str(stop)
    return env


def _copy_commit(src: Storage, c: layout.Candidate, dest: str) -> None:
    """Commit ``c`` (its manifest and the files it lists) into the local directory ``dest``."""
    assert c.manifest is not None  # verified
    os.makedirs(dest)
    for rel in [layout.MANIFEST, *layout.file_sizes(c.manifest)]:
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(src.read_bytes(src.join(c.name, rel)))


def audit(
    uri: str,
    first: int,
    last: int,
    endpoint_url: str = "",
    *,
    scratch_parent: str | None = None,
    replay: Replay = _launch,
    confirm: bool = True,
) -> list[Verdict]:
    """Audit the commits from step ``first`` to ``last`` under ``uri`` (see the module): one
    verdict per commit after ``first`` along the lineage of ``last``, each recorded beside its
    commit; one replay per segment (:func:`replay_segments`). After a suspect commit, later
    segments are not replayed: their commits descend from it. ConfigError (exit 2) for a bad
    root or range; CheckpointError when a replay fails. ``scratch_parent``: where the scratch
    directory goes (default: the system's temporary directory; removed at the end);
    ``replay``: runs a replay's launch (tests inject one). ``confirm``: a segment whose first
    replay finds a suspect commit is replayed a second time, and the two replays' verdicts
    break the tie (:func:`tie_break`: the audit's own machine may be the faulty one)."""
    check_uri(uri, "ROOT")
    storage = open_storage(uri, endpoint_url)
    storage.checks.access()
    if not storage.exists(storage.root):
        raise ConfigError("ROOT", f"no checkpoint root at {storage.describe()}")
    catalog = Catalog(storage)
    segments = replay_segments(audit_chain(catalog.scan(), first, last, catalog.key))
    verdicts: list[Verdict] = []
    for base, commits in segments:
        suspect = next((v for v in verdicts if v.suspect), None)
        if suspect is not None:
            verdicts += [Verdict(c.step, c.name, base.step, True, descends_from=suspect.step) for c in commits]
        else:
            found = _replay(catalog, base, commits, scratch_parent, replay)
            if confirm and any(v.suspect for v in found):
                found = tie_break(found, _replay(catalog, base, commits, scratch_parent, replay))
            verdicts += found
    recorded = _config(segments[-1][1][-1])
    events = _run_events(recorded)
    manifests = {c.name: c.manifest for _, commits in segments for c in commits}
    for v in verdicts:
        manifest = manifests[v.name]
        assert manifest is not None  # verified
        record_verdict(storage, v.name, v.record(manifest))
        events.emit("checkpoint_audited", **v.event_fields())
    return verdicts


def follow(
    uri: str,
    endpoint_url: str = "",
    *,
    until: int | None = None,
    poll_seconds: float = 30.0,
    report: Callable[[Verdict], None] = lambda v: None,
    sleep: Callable[[float], None] = time.sleep,
    **how: Any,
) -> bool:
    """``ckpt audit ROOT --follow``, beside a running job (on a spare node): audit each new head
    of the run's lineage once it is committed, from the newest certified commit before it (the
    run's start when there is none), every ``poll_seconds``; ``report`` gets each verdict. Ends
    False at the first suspect commit, True once a commit of step ``until`` or later is
    certified; runs until interrupted otherwise. ``how``: :func:`audit`'s keywords."""
    storage = open_storage(uri, endpoint_url)
    catalog = Catalog(storage)
    while True:
        candidates = catalog.scan()
        head = catalog.head(candidates)
        if head is not None and head.verdict is None:
            base = next((c.step for c in lineage(head, candidates)[1:] if c.verdict == layout.CERTIFIED), 0)
            verdicts = audit(uri, base, head.step, endpoint_url, **how)
            for v in verdicts:
                report(v)
            if any(v.suspect for v in verdicts):
                return False
        if head is not None and until is not None and head.step >= until:
            return True
        sleep(poll_seconds)


def record_verdict(storage: Storage, name: str, verdict: dict[str, Any]) -> None:
    """Record a verdict on the commit ``name`` beside its manifest (``audit.json``, written
    atomically; the commit's own files are untouched). ``verdict`` holds ``verdict``
    (``certified`` or ``suspect``) and ``manifest_checksum`` (the seal of the manifest it judged)."""
    write_json_atomic(storage, storage.join(name, layout.AUDIT), verdict)


def _config(c: layout.Candidate) -> dict[str, Any]:
    """The configuration commit ``c`` records (that of the launch that trained up to it)."""
    recorded = (c.manifest or {}).get("config")
    if not isinstance(recorded, dict):
        raise ConfigError("--from", f"the commit of step {c.step} records no configuration to replay it with")
    return recorded


def _replay(
    catalog: Catalog,
    base: layout.Candidate,
    commits: list[layout.Candidate],
    scratch_parent: str | None,
    replay: Replay,
) -> list[Verdict]:
    """One replay from ``base`` through ``commits`` (one segment), and their verdicts."""
    last = commits[-1].step
    scratch = tempfile.mkdtemp(prefix="elastic-trainer-audit-", dir=scratch_parent)
    try:
        path = os.path.join(scratch, "replay.toml")
        argv, cwd, only = replay_command(commits[-1].manifest or {}, path)
        cfg = replay_config(_config(commits[-1]), scratch, base, [c.step for c in commits], only)
        config_from_dict(cfg)  # a config this version cannot take stops here, naming the key
        if base.name:  # else the replay starts the run afresh
            _copy_commit(catalog.storage, base, os.path.join(scratch, "checkpoints", base.name))
        with open(path, "w") as f:
            f.write(toml_text(cfg))
        started = time.monotonic()
        code = replay(argv, _replay_env(last), os.path.join(scratch, REPLAY_LOG), cwd)
        seconds = round(time.monotonic() - started, 3)
        replayed = {c.step: c for c in Catalog(open_storage(cfg["checkpoint"]["dir"])).scan() if c.manifest}
        if code != 0:
            raise CheckpointError(f"the replay of steps {base.step}→{last} failed (exit {code}): {_tail(scratch)}")
        missing = [c.step for c in commits if c.step not in replayed]
        if missing:
            raise CheckpointError(f"the replay of steps {base.step}→{last} committed no step {missing[0]}")
        return [_judge(catalog, c, replayed[c.step], base.step, scratch, seconds) for c in commits]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _judge(
    catalog: Catalog, ours: layout.Candidate, replayed: layout.Candidate, base: int, scratch: str, seconds: float
) -> Verdict:
    """``ours`` against the replay's commit of the same step (``seconds``: the replay's)."""
    assert ours.manifest is not None and replayed.manifest is not None  # committed
    files = differing_files(ours.manifest, replayed.manifest)
    if not files:
        return Verdict(ours.step, ours.name, base, False, seconds=seconds)
    items = _items(catalog.read_metadata(ours))
    replay_dir = os.path.join(scratch, "checkpoints", replayed.name)
    scores: dict[tuple[int, str], float | None] = {}
    for rank, rel in files:
        mine = catalog.storage.read_bytes(catalog.storage.join(ours.name, rel))
        path = Path(replay_dir, rel)
        theirs = path.read_bytes() if path.exists() else b""
        for fqn, score in _scores(mine, theirs, items.get(rel, [])).items():
            scores[(rank, fqn)] = score
    tensors = {k: v for k, v in scores.items() if v is not None}
    objects = tuple(sorted({fqn for (_, fqn), v in scores.items() if v is None}))
    if scores and not tensors:  # only bookkeeping differs (a log with wall-clock times): every tensor is equal
        return Verdict(ours.step, ours.name, base, False, seconds=seconds, objects=objects)
    rank, tensor = locate(tensors) if tensors else (files[0][0], f"(file {files[0][1]})")
    per_node = int(ours.manifest.get("local_world_size") or ours.manifest.get("world_size") or 1)
    return Verdict(ours.step, ours.name, base, True, rank=rank, node=rank // per_node, tensor=tensor, seconds=seconds)


def _tail(scratch: str, chars: int = 1500) -> str:
    try:
        with open(os.path.join(scratch, REPLAY_LOG), errors="replace") as f:
            return f.read()[-chars:].strip() or "no output"
    except OSError:
        return "no output"


def _run_events(recorded: Mapping[str, Any]) -> EventLog:
    """The run's own event log (``run.dir/events.jsonl``) where this machine reaches it, else none."""
    run_dir = str((recorded.get("run") or {}).get("dir") or "")
    return EventLog(os.path.join(run_dir, contract.EVENTS_FILE) if run_dir and os.path.isdir(run_dir) else None)
