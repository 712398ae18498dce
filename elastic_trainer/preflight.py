"""Checks the supervisor runs before any worker starts: the checkpoint location is reachable
and writable with the given credentials, and the checkpoint that would be resumed verifies (and,
for ``launch``, whose model is known here, fits the model)."""

from __future__ import annotations

import logging
import os
import tempfile

from . import data_view
from .checkpoint import layout
from .checkpoint.catalog import Catalog, ResumePlan
from .config import Config, check_run_identity
from .errors import (
    CheckpointIncompatibleError,
    CheckpointMismatchError,
    ConfigError,
    NoUsableCheckpointError,
    StorageError,
)
from .storage.fs import Storage

logger = logging.getLogger(__name__)


def model_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Unsharded parameter shapes of the configured model, built on the meta device (free)."""
    from .models.spec import on_meta
    from .worker.model_factory import build_model

    with on_meta():
        model, _, _ = build_model(cfg.model)
    return {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}


def check_storage(cfg: Config) -> tuple[Catalog, ResumePlan | None]:
    """What ``launch`` and ``run`` check before any worker starts, without the training code:
    ``run.dir`` writable, ``checkpoint.dir`` reachable with the credentials at hand and writable,
    ``checkpoint.local_dir`` writable, and what a resume would load: the newest commit of the
    lineage verifies (sealed manifest, every file at its size), its format is one this version
    reads, and commits that exist are not all unusable. Returns the catalog and the resume plan (None for
    ``checkpoint.resume = "none"``). Raises ConfigError naming the key, or CheckpointStopError."""
    c = cfg.checkpoint
    _check_writable_dir("run.dir", cfg.run.dir)
    try:
        storage = Storage.for_checkpoint(c)
        storage.checks.access()
        storage.checks.writable()
    except StorageError as e:
        raise ConfigError("checkpoint.dir", f"cannot access {c.dir}: {e}") from None
    except Exception as e:  # noqa: BLE001 - e.g. credentials or endpoint errors from the client
        raise ConfigError("checkpoint.dir", f"cannot access {c.dir}: {type(e).__name__}: {e}") from None
    if c.local_dir:
        _check_writable_dir("checkpoint.local_dir", c.local_dir)
    catalog = Catalog(storage, certified_only=c.resume_certified_only)
    if c.resume == "none":
        return catalog, None
    plan = catalog.plan_resume(c.resume)
    if c.resume != "latest" and plan.chosen is None:
        reason = plan.skipped[0][1] if plan.skipped else "not found"
        raise ConfigError("checkpoint.resume", f"checkpoint step {c.resume} under {c.dir} is unusable: {reason}")
    stop = plan.stop_reason()
    if plan.incompatible is not None:
        raise CheckpointIncompatibleError(stop)
    if stop is not None:
        raise NoUsableCheckpointError(f"{c.dir}: {stop}")
    return catalog, plan


def preflight(cfg: Config) -> int | None:
    """``launch``'s checks before any worker starts: :func:`check_storage`, then that the
    checkpoint to resume fits the configured model, run identity and data. Returns the step that
    would be resumed (None for a fresh start). Raises ConfigError / CheckpointError naming the key.
    Imports torch's DCP only when the manifest cannot answer (another model fingerprint, a data
    view that differs or is not summarised): a node joining a running job asks to join sooner."""
    catalog, plan = check_storage(cfg)
    if plan is None or plan.chosen is None:
        return None
    assert plan.chosen.manifest is not None  # the chosen checkpoint is verified
    if plan.chosen.manifest.get("config_fingerprint") != cfg.model_fingerprint():
        # A different architecture is named as such (tensor and shapes) before any config key.
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = catalog.read_metadata(plan.chosen)
        saved = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        mismatch = layout.compare_shapes(saved, model_shapes(cfg), plan.chosen.step)
        if mismatch:
            raise CheckpointMismatchError(*mismatch)
    check_run_identity(cfg, plan.chosen.manifest.get("run_identity") or {})
    _check_data_view(cfg, catalog, plan.chosen)
    return plan.chosen.step


def _check_writable_dir(key: str, path: str) -> None:
    """``key``'s ``path`` must be a writable directory on this node (created if absent)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(key, f"cannot write to {path}: {e.strerror or e}") from None


def _check_data_view(cfg: Config, catalog: Catalog, chosen) -> None:
    """A resume reads the files recorded at the run's first start: stop here, naming the file,
    if one is gone or changed (the workers would stop on the same check)."""
    from .worker.sources import check_recorded_view, current_view

    summary = (chosen.manifest.get("summaries") or {}).get("data")
    try:
        if summary is not None and data_view.summary(current_view(cfg)) == summary:
            return  # data.path resolves to exactly the recorded files, unchanged: nothing to read
    except ConfigError:
        pass  # a file unreadable now: the recorded view names it (or the workers will)
    from torch.distributed.checkpoint.api import CheckpointException

    from .checkpoint.state import read_data_view

    try:
        recorded = read_data_view(catalog.reader(chosen))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged checkpoint is the workers' load to judge
        logger.warning("could not read the data view of %s before start: %s: %s", chosen.name, type(e).__name__, e)
        return
    ignored = [] if recorded is None else check_recorded_view(cfg, recorded)
    if ignored:
        logger.warning(
            "the resume reads the %d file(s) recorded at the run's first start; ignoring %d added since, e.g. %s",
            len(recorded or []),
            len(ignored),
            ignored[0],
        )
