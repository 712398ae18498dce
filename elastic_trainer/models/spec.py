"""What a model factory hands the trainer.

A factory (``model.factory = "pkg.module:function"``) is called as ``function(cfg)`` with the
:class:`~elastic_trainer.config.ModelConfig`, under ``torch.device("meta")``, and returns
either an ``nn.Module`` or a :class:`ModelSpec`. The trainer then shards the model, moves it to
the device with ``to_empty`` (which leaves every parameter *and buffer* uninitialised), and

1. fills each parameter from ``init_param(name, shape, generator)``: the parameter's *full*
   value, drawn only from ``generator`` (seeded by (train.seed, name)). Each rank keeps its
   shard, so the initial model is identical at every world size;
2. calls ``init_buffers(model)`` once per rank: it must write every floating-point buffer
   (e.g. rotary ``inv_freq``), deterministically and without collectives.

When a plain ``nn.Module`` is returned, ``init_param`` and ``init_buffers`` are taken from the
module's methods of those names if it has them; otherwise the default init is used (zeros for
``*.bias``, ones for other 1-D parameters, normal(0, model.init_std) for the rest) and a model
with floating-point buffers is refused (nothing would initialise them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

InitFn = Callable[[str, torch.Size, torch.Generator], torch.Tensor]
BufferInitFn = Callable[[nn.Module], None]


@dataclass
class ModelSpec:
    """A model built on the meta device plus how to initialise it.

    ``shard_modules``: class names ``fully_shard`` is applied to (bottom-up, before the root);
    ``model.shard_modules`` in the config overrides it. ``init_param``/``init_buffers``: see the
    module docstring; ``None`` means "use the default"."""

    model: nn.Module
    init_param: InitFn | None = None
    init_buffers: BufferInitFn | None = None
    shard_modules: list[str] = field(default_factory=list)
