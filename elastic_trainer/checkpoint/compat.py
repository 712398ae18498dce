"""Does a checkpoint fit the code? Compatibility, told apart from integrity before any load.

*Integrity* is about bytes: a file missing or short, a checksum or manifest seal that does not
verify, bytes that do not unpickle. Such a checkpoint is quarantined and the previous commit is
loaded. *Compatibility* is about an intact checkpoint that the code cannot take: keys missing or
unexpected, a shape or dtype that differs, a ``Stateful`` added, removed or renamed, another
optimizer or scheduler type, per-rank state at another world size. Older commits of the same run
have the same layout, so falling back or starting over would only lose work: the resume stops
(exit 2) naming every key, grouped by ``Stateful``, and nothing is quarantined or written.

:func:`check` decides it from the checkpoint's own metadata (the keys, shapes and dtypes DCP
recorded, and the types the manifest records) against the state the code registered, before a
byte of tensor data is read. Pure: the manager calls it once, on rank 0, and broadcasts the answer.
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointIntegrityError, StorageError
from .load_planner import flat_state, is_optional, optional_keys

SHOWN_PER_GROUP = 8  # keys listed per Stateful and kind; the rest are counted


@dataclass
class Report:
    """The comparison of a checkpoint with the registered state. ``problems`` by ``Stateful``
    name: lines naming keys. ``added``: keys absent from the checkpoint that the code declares
    optional (left as initialised). ``ignored``: ``Stateful`` names in the checkpoint that the
    code no longer registers (not loaded)."""

    problems: dict[str, list[str]] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    # optional Statefuls the checkpoint has nothing of: not loaded at all
    absent: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, group: str, line: str) -> None:
        self.problems.setdefault(group, []).append(line)

    def message(self, name: str) -> str:
        lines = [
            f"checkpoint {name} does not fit the state this code registers "
            "(the checkpoint is intact; nothing was quarantined or changed):"
        ]
        for group in sorted(self.problems):
            items = self.problems[group]
            shown = items[:SHOWN_PER_GROUP]
            more = f" (and {len(items) - len(shown)} more)" if len(items) > len(shown) else ""
            lines.append(f"  {group}: " + "; ".join(shown) + more)
        lines.append(
            "ways forward: register the same state as the run that wrote it; for state added on purpose set "
            "optional_on_load = True on that Stateful (it starts as initialised, event state_added); or start a new "
            'run: another checkpoint.dir, or checkpoint.resume = "none" for this launch'
        )
        return "\n".join(lines)


def _describe(value: Any) -> tuple:
    """``("tensor", shape, dtype)`` or ``("object",)`` for a flat state value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return ("object",)


def _saved_entries(metadata) -> dict[str, tuple]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for k, v in metadata.state_dict_metadata.items():
        out[k] = ("tensor", tuple(v.size), v.properties.dtype) if isinstance(v, TensorStorageMetadata) else ("object",)
    return out


def _fmt(entry: tuple) -> str:
    if entry[0] != "tensor":
        return "an object"
    dtype = str(entry[2]).removeprefix("torch.")
    return f"{dtype}{list(entry[1])}"


def check(
    states: dict[str, Any],
    metadata,
    manifest: dict[str, Any],
    world_size: int,
    *,
    state_dicts: dict[str, dict[str, Any]] | None = None,
) -> Report:
    """Compare what ``states`` (the registered ``Stateful`` objects, by checkpoint key) would
    load with what the checkpoint holds. ``state_dicts``: their ``state_dict()``s, where the
    caller has them; the others' are asked for once (no collectives)."""
    state_dicts = state_dicts or {}
    report = Report()
    saved = _saved_entries(metadata)
    saved_tops = {k.partition(".")[0] for k in saved}
    optional = optional_keys(states)
    saved_world = manifest.get("world_size")
    _check_types(report, states, manifest.get("state_types") or {})
    for key in sorted(saved_tops - set(states)):
        report.ignored.append(key)
    for key, obj in states.items():
        if getattr(obj, "per_rank", False):
            _check_per_rank(report, key, obj, key in saved_tops, saved_world, world_size, optional)
            continue
        sd = state_dicts[key] if key in state_dicts else obj.state_dict()
        expected = {k: _describe(v) for k, v in flat_state({key: sd}).items()}
        if key not in saved_tops:
            _check_absent(report, key, expected, optional)
            continue
        mine = {k: v for k, v in saved.items() if k.partition(".")[0] == key}
        _compare_entries(report, key, expected, mine, optional)
    return report


def _check_types(report: Report, states: dict[str, Any], recorded_types: dict[str, Any]) -> None:
    """The type each key's object had when the checkpoint was written (its manifest's
    ``state_types``) against the one registered now; a key the manifest does not record passes."""
    from .state import state_types

    for key, now in state_types(states).items():
        was = recorded_types.get(key)
        if was is None or was == now:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            for n in sorted(set(was) | set(now)):
                if was.get(n) != now.get(n):
                    report.add(
                        key,
                        f"{n}: the checkpoint holds {was.get(n) or 'nothing'}, "
                        f"the code registers {now.get(n) or 'nothing'}",
                    )
        else:
            report.add(key, f"the checkpoint holds {_type_name(was)}, the code registers {_type_name(now)}")


def _check_absent(
    report: Report, key: str, expected: dict[str, tuple], optional: dict[str, bool | tuple[str, ...]]
) -> None:
    """A registered key the checkpoint holds nothing of: added when it is optional on load, else a problem."""
    if optional.get(key) is True:
        report.added += sorted(expected) or [key]
        report.absent.append(key)
    else:
        keys = ", ".join(sorted(expected)[:SHOWN_PER_GROUP]) or key
        report.add(
            key,
            f"not in the checkpoint: {keys} (registered since it was written? set optional_on_load = True on it)",
        )


def _compare_entries(
    report: Report,
    key: str,
    expected: dict[str, tuple],
    saved: dict[str, tuple],
    optional: dict[str, bool | tuple[str, ...]],
) -> None:
    """``key``'s entries as the code would load them (``expected``) against the checkpoint's
    (``saved``): missing ones (unless optional), extra ones, and a shape or dtype that differs."""
    for k in sorted(set(expected) - set(saved)):
        if is_optional(k, optional):
            report.added.append(k)
        else:
            report.add(key, f"{k} missing from the checkpoint")
    for k in sorted(set(saved) - set(expected)):
        report.add(key, f"{k} in the checkpoint, not in the code")
    for k in sorted(set(saved) & set(expected)):
        if saved[k] != expected[k]:
            report.add(key, f"{k} is {_fmt(saved[k])} in the checkpoint, {_fmt(expected[k])} in the code")


def _check_per_rank(
    report: Report, key: str, obj: Any, present: bool, saved_world: Any, world_size: int, optional
) -> None:
    """Per-rank state: its copies map onto ranks only at the world size that wrote them."""
    if not present:
        if optional.get(key) is True:
            report.added.append(key)
            report.absent.append(key)
        elif getattr(obj, "can_reshard", None) is not None:  # a PerRank of the user's (RNG is optional)
            report.add(key, "per-rank state not in the checkpoint (registered since it was written?)")
        return
    if saved_world != world_size and getattr(obj, "can_reshard", True) is False:
        report.add(
            key,
            f"per-rank state saved by {saved_world} ranks cannot be "
            f"loaded by {world_size}: a rank's copy has no owner at "
            "another world size; give the object a reshard_state_dict(saved, rank, world_size) method, or resume at "
            f"world size {saved_world}",
        )


def _type_name(t: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(t.items())) if isinstance(t, dict) else str(t)


# ------------------------------------------------------------------------------- load failures
INTEGRITY_TYPES: tuple[type[BaseException], ...] = (
    CheckpointIntegrityError,
    StorageError,
    OSError,  # a file missing or unreadable (FileNotFoundError, short reads surfacing as OSError)
    EOFError,  # a short file
    pickle.UnpicklingError,
)


def root_causes(exc: BaseException) -> list[BaseException]:
    """The exceptions behind a DCP ``CheckpointException`` (one per failing rank), else ``[exc]``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
    return [exc]


def is_integrity(exc: BaseException) -> bool:
    """Whether a load failure is about the bytes (quarantine, fall back) rather than the code
    that reads them (stop, exit 2). Unpickling errors come as many types; a message naming the
    unpickler counts too."""
    for e in root_causes(exc):
        chain = [e] + ([e.__cause__] if e.__cause__ is not None else [])
        if any(
            isinstance(x, INTEGRITY_TYPES) or "unpickl" in str(x).lower() or "checksum" in str(x).lower() for x in chain
        ):
            return True
    return False


_ABS_PATH = re.compile(r"(?:[A-Za-z][A-Za-z0-9+.-]*://)?/[^\s'\"(),:;]+")


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` of the first root cause, on one line, without a traceback or absolute
    paths (each reduced to its last component): a reason a person reads in ``ckpt list``."""
    e = root_causes(exc)[0]
    text = " ".join(str(e).split())
    text = _ABS_PATH.sub(lambda m: os.path.basename(m.group(0).rstrip("/")) or m.group(0), text)
    out = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return out if len(out) <= limit else out[: limit - 3] + "..."
