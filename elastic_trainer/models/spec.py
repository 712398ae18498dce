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

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

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


# Value-filling in-place ops: ``torch.nn.init.*`` and the ``Tensor`` methods they and model
# ``_init_weights`` hooks call. None changes a tensor's shape, dtype or device.
_FILL_OPS = frozenset(
    {
        "normal_",
        "uniform_",
        "trunc_normal_",
        "constant_",
        "ones_",
        "zeros_",
        "eye_",
        "dirac_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "orthogonal_",
        "sparse_",
        "fill_",
        "zero_",
        "random_",
        "exponential_",
        "bernoulli_",
        "cauchy_",
        "log_normal_",
        "geometric_",
    }
)


class _SkipFillOnMeta(torch.overrides.TorchFunctionMode):
    """A value-filling op on a meta tensor returns the tensor: a meta tensor has no values, and
    torch would otherwise run the op through its reference implementations, whose first use
    imports ``torch._dynamo`` (about a second of every ``launch`` and cold worker start)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _FILL_OPS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build models here: ``torch.device("meta")`` (no memory) without running any
    initialiser (the trainer initialises every parameter after sharding, see above)."""
    with torch.device("meta"), _SkipFillOnMeta():
        yield
