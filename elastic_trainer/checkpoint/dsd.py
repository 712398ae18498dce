"""torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``, with the model's verified layout
kept from one save to the next.

Both public functions verify the model's layout on every call (``_verify_options``: every
parameter's and buffer's FQNs, shared parameters, FSDP(1) modules): ~2 ms of Python per call for
the demo model, on the training thread, at every save. That layout is a function of the module
tree and its parameter and buffer objects, so :class:`StateDicts` verifies it once and reuses it
while the parameters' and buffers' names and objects (and the optimizer's parameters) are the
same; any difference verifies again. The state itself is read afresh on every call, exactly as
the public functions read it (the same private functions, in the same order).

This is the one place that uses torch's private state-dict names; they are bound at import, so a
torch that renames or drops one fails here, loudly, at import (and tests/unit/test_dsd.py
compares every result with the public functions').
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as _dsd

_gc_context = _dsd._gc_context
_verify_options = _dsd._verify_options
_verify_state_dict = _dsd._verify_state_dict
_get_model_state_dict = _dsd._get_model_state_dict
_get_optim_state_dict = _dsd._get_optim_state_dict


class StateDicts:
    """The model's (and, with ``optimizer``, that optimizer's) DCP state dict, as
    ``get_model_state_dict(model)`` / ``get_optimizer_state_dict(model, optimizer)`` return it.
    ``verified``: how many times the layout was verified (1 while it holds)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model = model
        self.optimizer = optimizer
        self.verified = 0
        self._objects: tuple = ()  # what the layout was verified for (held: ids stay unique)
        self._key: tuple = ()
        self._info: Any = None

    def _layout(self) -> Any:
        m = self.model
        named = [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]
        grouped = [p for g in self.optimizer.param_groups for p in g["params"]] if self.optimizer is not None else []
        key = (tuple((n, id(t)) for n, t in named), tuple(map(id, grouped)))
        if self._info is None or key != self._key:
            optims = (self.optimizer,) if self.optimizer is not None else ()
            self._info = _verify_options(m, optims, optim_only=self.optimizer is not None)
            self._key, self._objects = key, (named, grouped)
            self.verified += 1
        return self._info

    def model_state_dict(self) -> dict[str, Any]:
        with _gc_context():
            info = self._layout()
            out = _get_model_state_dict(self.model, info)
            _verify_state_dict(out, {}, info)
            return out

    def optimizer_state_dict(self) -> dict[str, Any]:
        with _gc_context():
            info = self._layout()
            assert self.optimizer is not None  # asked only of a model with an optimizer
            out = _get_optim_state_dict(self.model, (self.optimizer,), info)
            _verify_state_dict({}, out, info)
            return out
