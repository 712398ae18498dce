"""Checks the supervisor runs before any worker starts: the checkpoint location is reachable
with the given credentials, and the checkpoint that would be resumed verifies and fits the model."""

from __future__ import annotations

import logging
import os
import tempfile

from .checkpoint import layout
from .checkpoint.catalog import Catalog
from .config import Config, check_run_identity
from .errors import CheckpointMismatchError, ConfigError, StorageError
from .storage.fs import open_storage

logger = logging.getLogger(__name__)


def model_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Unsharded parameter shapes of the configured model, built on the meta device (free)."""
    from .models.spec import on_meta
    from .worker.model_factory import build_model

    with on_meta():
        model, _, _ = build_model(cfg.model)
    return {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}


def preflight(cfg: Config) -> int | None:
    """Returns the step that would be resumed (None for a fresh start). Raises ConfigError /
    CheckpointMismatchError naming the key."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    c = cfg.checkpoint
    try:
        storage = open_storage(c.dir, c.s3_endpoint_url, c.storage_timeout_seconds, c.storage_retries)
        storage.check_access()
    except StorageError as e:
        raise ConfigError("checkpoint.dir", f"cannot access {c.dir}: {e}") from None
    except Exception as e:  # noqa: BLE001 - e.g. credentials or endpoint errors from the client
        raise ConfigError("checkpoint.dir", f"cannot access {c.dir}: {type(e).__name__}: {e}") from None
    if c.local_dir:
        _check_local_dir(c.local_dir)
    if c.resume == "none":
        return None
    catalog = Catalog(storage)
    plan = catalog.plan_resume(c.resume)
    if c.resume != "latest" and plan.chosen is None:
        reason = plan.skipped[0][1] if plan.skipped else "not found"
        raise ConfigError("checkpoint.resume", f"checkpoint step {c.resume} under {c.dir} is unusable: {reason}")
    if plan.chosen is None:
        return None
    if plan.chosen.manifest.get("config_fingerprint") != cfg.model_fingerprint():
        # A different architecture is named as such (tensor and shapes) before any config key.
        meta = catalog.read_metadata(plan.chosen)
        saved = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        mismatch = layout.compare_shapes(saved, model_shapes(cfg), plan.chosen.step)
        if mismatch:
            raise CheckpointMismatchError(*mismatch)
    check_run_identity(cfg, plan.chosen.manifest.get("run_identity") or {})
    _check_data_view(cfg, catalog, plan.chosen)
    return plan.chosen.step


def _check_local_dir(path: str) -> None:
    """checkpoint.local_dir must be a writable directory on this node (created if absent)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError("checkpoint.local_dir", f"cannot write to {path}: {e.strerror or e}") from None


def _check_data_view(cfg: Config, catalog: Catalog, chosen) -> None:
    """A resume reads the files recorded at the run's first start: stop here, naming the file,
    if one is gone or changed (the workers would stop on the same check)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from .checkpoint.state import read_data_view
    from .worker.sources import check_recorded_view

    try:
        recorded = read_data_view(catalog.reader(chosen))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged checkpoint is the workers' load to judge
        logger.warning("could not read the data view of %s before start: %s: %s", chosen.name, type(e).__name__, e)
        return
    ignored = [] if recorded is None else check_recorded_view(cfg, recorded)
    if ignored:
        logger.warning("the resume reads the %d file(s) recorded at the run's first start; ignoring %d added since, e.g. %s", len(recorded or []), len(ignored), ignored[0])
