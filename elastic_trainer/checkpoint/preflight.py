"""Checks the supervisor runs before any worker starts: the checkpoint location is reachable
with the given credentials, and the checkpoint that would be resumed fits the model."""

from __future__ import annotations

import logging

import torch

from ..config import Config
from ..errors import CheckpointMismatchError, ConfigError, StorageError
from ..storage.fs import open_storage
from . import layout, scan

logger = logging.getLogger(__name__)


def model_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Unsharded parameter shapes of the configured model, built on the meta device (free)."""
    from ..worker.model_factory import build_model

    with torch.device("meta"):
        model, _, _ = build_model(cfg.model)
    return {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}


def compare_shapes(saved: dict[str, tuple[int, ...]], ours: dict[str, tuple[int, ...]], step: int) -> tuple[str, str] | None:
    """First difference between checkpoint and model tensors (pure)."""
    for k in sorted(ours):
        if k not in saved:
            return k, f"the model has {k} {list(ours[k])} but the checkpoint of step {step} does not (different architecture)"
        if saved[k] != ours[k]:
            return k, f"shape {list(saved[k])} in the checkpoint of step {step}, {list(ours[k])} in the model (different architecture)"
    extra = sorted(k for k in saved if k.startswith("model.") and k not in ours)
    if extra:
        return extra[0], f"the checkpoint of step {step} has {extra[0]}, which the model does not (different architecture)"
    return None


def preflight(cfg: Config) -> int | None:
    """Returns the step that would be resumed (None for a fresh start). Raises ConfigError /
    CheckpointMismatchError naming the key."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    c = cfg.checkpoint
    try:
        storage = open_storage(c.dir, c.s3_endpoint_url, c.storage_timeout_seconds, c.storage_retries)
        storage.check_access()
        names = storage.list_dirs()
    except StorageError as e:
        raise ConfigError("checkpoint.dir", f"cannot access {c.dir}: {e}") from None
    except Exception as e:  # noqa: BLE001 - e.g. credentials or endpoint errors from the client
        raise ConfigError("checkpoint.dir", f"cannot access {c.dir}: {type(e).__name__}: {e}") from None
    if c.resume == "none":
        return None
    candidates = scan.scan(storage, names)
    sel = layout.select_for_resume(candidates, c.resume)
    if c.resume != "latest" and sel.chosen is None:
        reason = sel.skipped[0][1] if sel.skipped else "not found"
        raise ConfigError("checkpoint.resume", f"checkpoint step {c.resume} under {c.dir} is unusable: {reason}")
    if sel.chosen is None:
        return None
    if sel.chosen.manifest.get("config_fingerprint") == cfg.model_fingerprint():
        return sel.chosen.step
    meta = storage.dcp_reader(storage.join(sel.chosen.name)).read_metadata()
    saved = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    mismatch = compare_shapes(saved, model_shapes(cfg), sel.chosen.step)
    if mismatch:
        raise CheckpointMismatchError(*mismatch)
    return sel.chosen.step
