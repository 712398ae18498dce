"""A DCP load planner that lets some state be absent from a checkpoint.

DCP's ``DefaultLoadPlanner`` refuses a load when any key of the state to fill is missing from
the checkpoint (or, with ``allow_partial_load``, silently leaves *every* missing key as it was,
the model's included). Per-rank generator states and the recorded data view may legitimately
be missing: a rank that did not exist when the checkpoint was saved, a checkpoint written
before they were saved. :class:`OptionalKeysLoadPlanner` tolerates absence only under the
top-level keys of ``Stateful`` objects that declare ``optional_on_load = True``, and removes
the missing leaves from the nested state dict the ``Stateful`` gets back, so its
``load_state_dict`` sees what was (not) restored. Everything else stays strict.

This relies on ``DefaultLoadPlanner``'s ``state_dict`` (flattened), ``mappings`` (flat key →
nested path) and ``original_state_dict`` attributes; tests/dist/test_rng_state.py fails loudly
if a torch release changes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


class OptionalKeysLoadPlanner(DefaultLoadPlanner):
    def __init__(self, optional: Iterable[str]):
        super().__init__()
        self.optional = frozenset(optional)
        self.absent: list[str] = []

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = metadata.state_dict_metadata if metadata is not None else {}
        for fqn in list(self.state_dict):
            path = self.mappings.get(fqn, (fqn,)) if self.flatten_state_dict else (fqn,)
            if path[0] in self.optional and fqn not in saved:
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
    return OptionalKeysLoadPlanner(k for k, s in states.items() if getattr(s, "optional_on_load", False))
