"""Process groups, device mesh, FSDP2 sharding and world-size-independent initialisation."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config import TrainConfig
from ..errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    ckpt_group: dist.ProcessGroup  # gloo, for checkpoint collectives only


def pick_device(train: TrainConfig, local_rank: int) -> torch.device:
    if train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda requested but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(train: TrainConfig, timeout_seconds: float, ckpt_timeout_seconds: float | None = None) -> Dist:
    """Initialise the training group (NCCL on CUDA, gloo on CPU) and a separate gloo group for
    checkpoints. Must be called on all ranks. ``timeout_seconds`` bounds every training
    collective; ``ckpt_timeout_seconds`` (default: the same) the checkpoint group's, whose
    collectives wait for storage (a gloo timeout there breaks the group for every later save)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(train, local_rank)
    timeout = timedelta(seconds=timeout_seconds)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    ckpt_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=ckpt_timeout_seconds or timeout_seconds))
    return Dist(rank, world, local_rank, device, mesh, ckpt_group)


def mixed_precision_policy(train: TrainConfig, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute + fp32 gradient reduction on CUDA (``auto``), fp32 on CPU unless asked."""
    mode = train.mixed_precision
    if mode == "auto":
        mode = "bf16" if device.type == "cuda" else "fp32"
    if mode == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def resolve_shard_classes(model: nn.Module, names: list[str], key: str = "model.shard_modules") -> list[type]:
    classes = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in classes]
    if missing:
        raise ConfigError(key, f"no module of class {', '.join(missing)} in the model (classes present: {', '.join(sorted(classes))})")
    return [classes[n] for n in names]


def shard_model(model: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy, shard_classes: list[type]) -> nn.Module:
    """``fully_shard`` bottom-up: every module of ``shard_classes`` (post-order), then the root.

    Gradients are reduced as a SUM (divide factor 1): the loss is already normalised by the
    global target count, so the summed gradient is the global mean at any world size.
    """
    targets = [m for m in model.modules() if m is not model and isinstance(m, tuple(shard_classes))]
    for m in reversed(targets):
        fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in [*targets, model]:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    unsharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if unsharded:
        raise ConfigError("model.shard_modules", f"parameters left unsharded: {', '.join(unsharded[:5])}")
    return model


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def deterministic_init(model: nn.Module, seed: int, init_param: Callable[[str, torch.Size, torch.Generator], torch.Tensor]) -> None:
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
            local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and buf.device.type == "meta":
            raise ConfigError("model.factory", f"buffer {name} stays on the meta device: the model must initialise it")


def local_param_bytes(model: nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
