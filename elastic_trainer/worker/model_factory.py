"""Model construction seam: the demo GPT or a user factory (``model.factory``).

:func:`build_model_spec` returns a fully resolved :class:`~elastic_trainer.models.ModelSpec`
(model on the current device, normally meta; ``init_param``; ``init_buffers``; the class names
to shard). ``init_param(name, shape, generator)`` gives a parameter's full initial value; it is
what makes initialisation identical at every world size (see
:func:`elastic_trainer.worker.parallel.deterministic_init`). The factory contract is documented
in :mod:`elastic_trainer.models.spec` and ``docs/own-model.md``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from ..models.spec import BufferInitFn, InitFn, ModelSpec, on_meta
from .model import GPT

__all__ = ["InitFn", "build_model", "build_model_spec", "check_model", "initialise_buffers", "load_factory"]


def default_init_param(std: float) -> InitFn:
    """Zeros for ``*.bias``, ones for other 1-D parameters (norm weights), normal(0, std) otherwise."""

    def init(name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if len(shape) == 1:
            return torch.ones(shape)
        return torch.empty(shape).normal_(0.0, std, generator=g)

    return init


def _no_buffers(model: nn.Module) -> None:
    return None


def load_factory(path: str, key: str = "model.factory") -> Callable[[ModelConfig], object]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(key, f"expected 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(key, f"cannot import module {module_name!r} of {path!r}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(key, f"module {module_name!r} has no callable {attr!r} (from {path!r})")
    return fn


def build_model_spec(cfg: ModelConfig) -> ModelSpec:
    """Build on the current (meta) device and resolve every part of the spec.

    Raises ConfigError naming ``model.factory`` (unimportable, wrong return type, buffers nobody
    initialises) or ``model.shard_modules`` (no class names, or a name that matches no module)."""
    if not cfg.factory:
        gpt = GPT(cfg)
        spec = ModelSpec(gpt, gpt.init_param, _no_buffers, list(cfg.shard_modules or ["Block"]))
    else:
        factory = load_factory(cfg.factory)
        try:
            out = factory(cfg)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError("model.factory", f"{cfg.factory} raised {type(e).__name__}: {e}") from e
        spec = out if isinstance(out, ModelSpec) else ModelSpec(cast(nn.Module, out))  # checked just below
        if not isinstance(spec.model, nn.Module):
            raise ConfigError(
                "model.factory",
                f"{cfg.factory} returned {type(spec.model).__name__}, not a torch.nn.Module or ModelSpec",
            )
        model = spec.model
        spec.init_param = spec.init_param or getattr(model, "init_param", None) or default_init_param(cfg.init_std)
        method = getattr(model, "init_buffers", None)
        if spec.init_buffers is None and callable(method):
            spec.init_buffers = lambda _model: method()
        if spec.init_buffers is None:
            buffers = [n for n, _ in model.named_buffers()]
            if buffers:
                raise ConfigError(
                    "model.factory",
                    f"{cfg.factory} built a model with buffers "
                    f"({', '.join(buffers[:3])}) but provides no init_buffers: "
                    "the model is moved off the meta device with to_empty, which leaves buffers uninitialised "
                    "(return a ModelSpec with init_buffers, or give the module an init_buffers() method)",
                )
            spec.init_buffers = _no_buffers
        spec.shard_modules = list(cfg.shard_modules or spec.shard_modules)
        if not spec.shard_modules:
            raise ConfigError(
                "model.shard_modules",
                f'{cfg.factory} gives no classes to shard: set model.shard_modules, e.g. ["DecoderLayer"]',
            )
    check_shard_modules(spec.model, spec.shard_modules)
    return spec


def check_shard_modules(model: nn.Module, names: list[str], key: str = "model.shard_modules") -> None:
    present = {type(m).__name__ for m in model.modules() if m is not model}
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(
            key,
            f"no module of class {', '.join(map(repr, missing))} in "
            f"the model (classes present: {', '.join(sorted(present))})",
        )


def build_model(cfg: ModelConfig) -> tuple[nn.Module, InitFn, list[str]]:
    """``(model, init_param, shard_module_names)``: the spec without the buffer initialiser, for
    callers that only need shapes (e.g. the checkpoint preflight)."""
    spec = build_model_spec(cfg)
    assert spec.init_param is not None  # build_model_spec resolves it
    return spec.model, spec.init_param, spec.shard_modules


def check_model(cfg: ModelConfig) -> None:
    """Supervisor-side check before any worker starts: the factory imports, returns a module,
    and every ``model.shard_modules`` class exists. Builds on the meta device (no memory)."""
    with on_meta():
        build_model_spec(cfg)


@torch.no_grad()
def initialise_buffers(model: nn.Module, init_buffers: BufferInitFn, key: str = "model.factory") -> None:
    """Run ``init_buffers`` after ``to_empty`` and prove it wrote every floating-point buffer:
    each is filled with NaN first, so one left untouched is caught instead of training on
    whatever memory ``to_empty`` returned."""
    floats = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    for _, b in floats:
        b.fill_(float("nan"))
    init_buffers(model)
    left = [n for n, b in model.named_buffers() if b.is_floating_point() and bool(torch.isnan(b).any())]
    if left:
        raise ConfigError(key, f"buffers not initialised by the model's init_buffers: {', '.join(left[:5])}")
