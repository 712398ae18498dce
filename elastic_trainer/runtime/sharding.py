"""FSDP2 sharding that keeps the loss curve independent of the world size.

FSDP2 averages gradients over the data-parallel ranks by default; with a loss normalised by the
*global* batch (or target count) that would divide the gradient by the world size a second time
and change clipping and Adam's epsilon balance with every reshard. :func:`shard_model` reduces
gradients as a SUM instead, so the gradient is the global mean at any world size.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..config import TrainConfig
from ..errors import ConfigError


def mixed_precision_policy(train: TrainConfig, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute + fp32 gradient reduction on CUDA (``auto``), fp32 on CPU unless asked."""
    mode = train.mixed_precision
    if mode == "auto":
        mode = "bf16" if device.type == "cuda" else "fp32"
    if mode == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def shard_model(model: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy, shard_classes: list[type]) -> nn.Module:
    """``fully_shard`` bottom-up: every module of ``shard_classes`` (post-order), then the root.

    Gradients are reduced as a SUM (divide factor 1): the loss is already normalised by the
    global target count, so the summed gradient is the global mean at any world size.

    Under a lower-precision policy the root's outputs are cast back to fp32: the model computes
    in bf16, and the loss the caller writes (``F.mse_loss(model(x), y)`` with fp32 targets, a
    cross-entropy over the logits) runs in fp32 as it does on CPU. Without it the backward of a
    loss that mixes bf16 outputs with fp32 targets fails on CUDA only.
    """
    targets = [m for m in model.modules() if m is not model and isinstance(m, tuple(shard_classes))]
    for m in reversed(targets):
        fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=_fp32_outputs(mp))
    for m in [*targets, model]:
        sharded = cast(FSDPModule, m)  # fully_shard made it one
        sharded.set_gradient_divide_factor(1.0)
        sharded.set_force_sum_reduction_for_comms(True)
    unsharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if unsharded:
        raise ConfigError("model.shard_modules", f"parameters left unsharded: {', '.join(unsharded[:5])}")
    return model


def _fp32_outputs(mp: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    if mp.param_dtype in (None, torch.float32) or mp.output_dtype is not None:
        return mp
    return dataclasses.replace(mp, output_dtype=torch.float32)
