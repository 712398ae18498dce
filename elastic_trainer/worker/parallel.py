"""Process groups, device mesh, FSDP2 sharding and world-size-independent initialisation."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..errors import ConfigError
from ..runtime.sharding import mixed_precision_policy, shard_model  # noqa: F401 - re-exported for the worker

logger = logging.getLogger(__name__)


def resolve_shard_classes(model: nn.Module, names: list[str], key: str = "model.shard_modules") -> list[type]:
    classes = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in classes]
    if missing:
        raise ConfigError(
            key, f"no module of class {', '.join(missing)} in the model (classes present: {', '.join(sorted(classes))})"
        )
    return [classes[n] for n in names]


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def deterministic_init(
    model: nn.Module, seed: int, init_param: Callable[[str, torch.Size, torch.Generator], torch.Tensor]
) -> None:
    """Give every parameter the same initial value at every world size.

    Each parameter's *full* value is drawn from its own generator, seeded by (seed, name), and
    each rank keeps only its shard (``distribute_tensor(..., src_data_rank=None)``: no
    communication). Costs one full parameter of host memory at a time.
    """
    for name, param in model.named_parameters():
        full = init_param(name, param.shape, torch.Generator().manual_seed(_param_seed(seed, name)))
        if tuple(full.shape) != tuple(param.shape):
            raise AssertionError(f"init for {name} gave {tuple(full.shape)}, expected {tuple(param.shape)}")
        if isinstance(param, DTensor):
            local = distribute_tensor(
                full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and buf.device.type == "meta":
            raise ConfigError("model.factory", f"buffer {name} stays on the meta device: the model must initialise it")


def local_param_bytes(model: nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
