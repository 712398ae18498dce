"""``elastic-trainer ckpt list | inspect | export``: read-only tools over a checkpoint root
(``ckpt release`` and ``ckpt audit`` write markers beside commits: see :mod:`.catalog`, :mod:`.audit`)."""

from __future__ import annotations

from typing import Any

import torch

from ..config import check_uri
from ..errors import CheckpointError
from ..storage.fs import open_storage
from . import layout
from .catalog import Catalog, lineage


def _catalog(uri: str, endpoint_url: str) -> Catalog:
    """The catalog of an existing checkpoint root; errors name ``URI`` (the tools' argument).

    Raises ConfigError for a URI that is not a checkpoint location, CheckpointError when
    nothing exists there (a typo must not read as "no checkpoints yet")."""
    check_uri(uri, "URI")
    storage = open_storage(uri, endpoint_url)
    storage.checks.access()
    if not storage.exists(storage.root):
        raise CheckpointError(f"no checkpoint root at {storage.describe()}")
    return Catalog(storage)


def list_checkpoints(uri: str, endpoint_url: str = "") -> list[dict[str, Any]]:
    """One row per ``step-*`` directory, oldest first: step, name, world size, bytes, committed,
    valid, why not, and its status: ``head`` (what ``latest`` resumes), ``lineage`` (an ancestor
    of the head), ``parked`` (a valid commit off the current lineage: never picked by ``latest``),
    ``suspect`` (``ckpt audit`` found it suspect, or it descends from such a commit: never
    resumed from), ``quarantined``, ``invalid`` or ``uncommitted``."""
    catalog = _catalog(uri, endpoint_url)
    candidates = catalog.scan()
    suspects = layout.suspect_reasons(candidates)
    head = catalog.head(candidates)
    ancestors = {c.name for c in lineage(head, candidates)}
    rows = []
    for cand in candidates:
        manifest = cand.manifest
        problem = catalog.problem(cand)
        if manifest is None:
            status = "uncommitted"
        elif cand.quarantine is not None:
            status = "quarantined"
        elif problem:
            status = "invalid"
        elif cand.name in suspects:
            status, problem = "suspect", suspects[cand.name]
        elif head is not None and cand.name == head.name:
            status = "head"
        else:
            status = "lineage" if cand.name in ancestors else "parked"
        rows.append(
            {
                "step": cand.step,
                "name": cand.name,
                "committed": manifest is not None,
                "valid": problem is None,
                "status": status,
                "problem": problem,
                "world_size": (manifest or {}).get("world_size"),
                "bytes": (manifest or {}).get("total_bytes", sum(cand.files.values())),
                "time": (manifest or {}).get("time"),
            }
        )
    return sorted(rows, key=lambda r: (r["step"], r["name"]))


def release(uri: str, step: int, endpoint_url: str = "") -> tuple[str, dict[str, Any]]:
    """Lift the quarantine of the newest quarantined directory of ``step`` after re-verifying
    every byte of it (:meth:`Catalog.release`). Returns (name, the lifted marker)."""
    catalog = Catalog(open_storage(uri, endpoint_url))
    mine = sorted(
        (c for c in catalog.scan() if c.step == step and c.quarantine is not None), key=lambda c: c.gen, reverse=True
    )
    if not mine:
        raise CheckpointError(f"no quarantined checkpoint of step {step} under {uri}")
    return mine[0].name, catalog.quarantine.release(mine[0].name)


def _pick(uri: str, step: int | None, endpoint_url: str):
    """(catalog, candidate) of ``step`` (its newest valid directory), or of the head."""
    catalog = _catalog(uri, endpoint_url)
    candidates = catalog.scan()
    if step is None:
        chosen = catalog.head(candidates)
        if chosen is None:
            raise CheckpointError(f"no valid committed checkpoint under {uri}")
        return catalog, chosen
    mine = sorted((c for c in candidates if c.step == step), key=lambda c: c.gen, reverse=True)
    if not mine:
        raise CheckpointError(f"no checkpoint of step {step} under {uri}")
    problems = []
    for c in mine:
        problem = catalog.problem(c)
        if problem is None:
            return catalog, c
        problems.append(f"{c.name}: {problem}")
    raise CheckpointError(
        f"checkpoint of step {step} under {uri} is unusable ({'; '.join(problems)}): refused before reading it"
    )


def inspect_checkpoint(uri: str, step: int | None = None, endpoint_url: str = "") -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    catalog, c = _pick(uri, step, endpoint_url)
    meta = catalog.read_metadata(c)
    tensors = {}
    for key, m in sorted(meta.state_dict_metadata.items()):
        if isinstance(m, TensorStorageMetadata):
            tensors[key] = {
                "shape": list(m.size),
                "dtype": str(m.properties.dtype).replace("torch.", ""),
                "chunks": len(m.chunks),
            }
        elif isinstance(m, BytesStorageMetadata):
            tensors[key] = {"bytes_object": True}
    return {"step": c.step, "name": c.name, "manifest": c.manifest, "files": c.files, "entries": tensors}


def load_model_weights(
    uri: str, step: int | None = None, endpoint_url: str = ""
) -> tuple[int, dict[str, torch.Tensor]]:
    """Consolidated (unsharded) model weights of a checkpoint, in this process, no process group."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    catalog, c = _pick(uri, step, endpoint_url)
    step = c.step
    sd = _load_state_dict_from_keys(keys={"model"}, storage_reader=catalog.reader(c))
    model = sd.get("model")
    if not model:
        raise CheckpointError(f"checkpoint of step {step} has no model weights")
    return step, {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def export_safetensors(
    uri: str, out: str, step: int | None = None, dtype: str = "fp32", endpoint_url: str = ""
) -> dict[str, Any]:
    from safetensors.torch import save_file

    step, weights = load_model_weights(uri, step, endpoint_url)
    target = torch.bfloat16 if dtype == "bf16" else torch.float32
    tensors = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
    save_file(tensors, out, metadata={"step": str(step), "source": uri, "format": "pt"})
    return {
        "step": step,
        "out": out,
        "tensors": len(tensors),
        "dtype": dtype,
        "parameters": sum(v.numel() for v in tensors.values()),
    }
