"""Model construction seam: the demo GPT or a user factory (``model.factory``).

Returns ``(model, init_param, shard_module_names)``. ``init_param(name, shape, generator)``
gives a parameter's full initial value; it is what makes initialisation identical at every
world size (see :func:`elastic_trainer.worker.parallel.deterministic_init`).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .model import GPT

InitFn = Callable[[str, torch.Size, torch.Generator], torch.Tensor]


def _default_init(model: nn.Module, std: float) -> InitFn:
    def init(name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if len(shape) == 1:
            return torch.ones(shape)
        return torch.empty(shape).normal_(0.0, std, generator=g)

    return init


def load_factory(path: str, key: str = "model.factory") -> Callable[[ModelConfig], nn.Module]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(key, f"cannot import module {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(key, f"module {module_name!r} has no callable {attr!r}")
    return fn


def build_model(cfg: ModelConfig) -> tuple[nn.Module, InitFn, list[str]]:
    """Build on the current (meta) device."""
    if not cfg.factory:
        model = GPT(cfg)
        return model, model.init_param, cfg.shard_modules or ["Block"]
    model = load_factory(cfg.factory)(cfg)
    if not isinstance(model, nn.Module):
        raise ConfigError("model.factory", f"{cfg.factory} returned {type(model).__name__}, not a torch.nn.Module")
    if not cfg.shard_modules:
        raise ConfigError("model.shard_modules", "a user model needs the class names to shard, e.g. [\"DecoderLayer\"]")
    init = getattr(model, "init_param", None) or _default_init(model, cfg.init_std)
    return model, init, list(cfg.shard_modules)
