"""A DCP load planner that lets some state be absent from a checkpoint, and the flat view of a
state dict that DCP saves and loads (keys as in the checkpoint's metadata).

DCP's ``DefaultLoadPlanner`` refuses a load when any key of the state to fill is missing from
the checkpoint (or, with ``allow_partial_load``, silently leaves *every* missing key as it was,
the model's included). Some state may legitimately be missing: per-rank generator states of a
rank that did not exist when the checkpoint was saved, state added to a job on purpose, fields
a checkpoint written by an earlier version does not have. :class:`OptionalKeysLoadPlanner`
tolerates absence only where the ``Stateful`` says so with ``optional_on_load``: ``True`` (any
of its keys) or a collection of key prefixes below it (``("state",)``: ``<name>.state`` and
everything under it). It removes the missing leaves from the nested state dict the ``Stateful``
gets back, so its ``load_state_dict`` sees what was (not) restored. Everything else stays strict.

This relies on ``DefaultLoadPlanner``'s ``state_dict`` (flattened), ``mappings`` (flat key →
nested path) and ``original_state_dict`` attributes; tests/dist/test_rng_state.py fails loudly
if a torch release changes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


def optional_keys(states: dict[str, Any]) -> dict[str, bool | tuple[str, ...]]:
    """``{top-level key: True | prefixes}`` of the ``Stateful`` objects that declare ``optional_on_load``."""
    out: dict[str, bool | tuple[str, ...]] = {}
    for k, s in states.items():
        opt = getattr(s, "optional_on_load", False)
        if opt is True:
            out[k] = True
        elif opt:
            out[k] = tuple(opt)
    return out


def is_optional(fqn: str, optional: dict[str, bool | tuple[str, ...]]) -> bool:
    """Whether the flat key ``fqn`` may be absent from a checkpoint."""
    top, _, rest = fqn.partition(".")
    opt = optional.get(top)
    if opt is True:
        return True
    if not opt:
        return False
    return any(rest == p or rest.startswith(p + ".") for p in opt)


class OptionalKeysLoadPlanner(DefaultLoadPlanner):
    def __init__(self, optional: dict[str, bool | tuple[str, ...]] | Iterable[str]):
        super().__init__()
        self.optional: dict[str, bool | tuple[str, ...]] = (
            optional if isinstance(optional, dict) else {k: True for k in optional}
        )
        self.absent: list[str] = []

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = metadata.state_dict_metadata if metadata is not None else {}
        for fqn in list(self.state_dict):
            path = self.mappings.get(fqn, (fqn,)) if self.flatten_state_dict else (fqn,)
            if fqn not in saved and is_optional(fqn, self.optional):
                del self.state_dict[fqn]
                _remove(self.original_state_dict, path)
                self.absent.append(fqn)


def _remove(nested: dict[str, Any], path: tuple) -> None:
    """Delete the leaf at ``path`` and then every dict below the top-level entry that became empty."""
    parents = [nested]
    for part in path[:-1]:
        parents.append(parents[-1][part])
    del parents[-1][path[-1]]
    for depth in range(len(path) - 1, 1, -1):
        if parents[depth] == {}:
            del parents[depth - 1][path[depth - 1]]


def load_planner(states: dict[str, Any]) -> OptionalKeysLoadPlanner:
    """The planner for ``dcp.load(states)``: optional where the ``Stateful`` says so."""
    return OptionalKeysLoadPlanner(optional_keys(states))


def flat_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The flat ``{key: value}`` DCP makes of a (plain, nested) state dict: the keys of a
    checkpoint's ``state_dict_metadata``."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, None, True)
    return dict(planner.state_dict)
