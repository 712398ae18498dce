"""``elastic-trainer ckpt list | inspect | export``: read-only tools over a checkpoint root."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from ..errors import CheckpointError
from ..storage.fs import open_storage
from . import layout, scan


def list_checkpoints(uri: str, endpoint_url: str = "") -> list[dict[str, Any]]:
    """One row per ``step-*`` directory, newest last: step, world size, bytes, committed, valid."""
    storage = open_storage(uri, endpoint_url)
    rows = []
    for cand in scan.scan(storage):
        step, manifest = cand.step, cand.manifest
        files = cand.files
        problem = layout.verify(cand)
        rows.append(
            {
                "step": step,
                "committed": manifest is not None,
                "valid": problem is None,
                "problem": problem,
                "world_size": (manifest or {}).get("world_size"),
                "bytes": (manifest or {}).get("total_bytes", sum(files.values())),
                "time": (manifest or {}).get("time"),
            }
        )
    return sorted(rows, key=lambda r: r["step"])


def _pick_step(uri: str, step: int | None, endpoint_url: str) -> int:
    rows = list_checkpoints(uri, endpoint_url)
    if step is not None:
        if not any(r["step"] == step for r in rows):
            raise CheckpointError(f"no checkpoint of step {step} under {uri}")
        return step
    valid = [r["step"] for r in rows if r["valid"]]
    if not valid:
        raise CheckpointError(f"no committed checkpoint under {uri}")
    return valid[-1]


def inspect_checkpoint(uri: str, step: int | None = None, endpoint_url: str = "") -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    step = _pick_step(uri, step, endpoint_url)
    storage = open_storage(uri, endpoint_url)
    d = storage.join(layout.step_dir_name(step))
    files = storage.list_files(d)
    manifest = storage.read_json(storage.join(layout.step_dir_name(step), layout.MANIFEST)) if layout.MANIFEST in files else None
    meta = storage.dcp_reader(d).read_metadata()
    tensors = {}
    for key, m in sorted(meta.state_dict_metadata.items()):
        if isinstance(m, TensorStorageMetadata):
            tensors[key] = {"shape": list(m.size), "dtype": str(m.properties.dtype).replace("torch.", ""), "chunks": len(m.chunks)}
        elif isinstance(m, BytesStorageMetadata):
            tensors[key] = {"bytes_object": True}
    return {"step": step, "manifest": manifest, "files": files, "entries": tensors}


def load_model_weights(uri: str, step: int | None = None, endpoint_url: str = "") -> tuple[int, dict[str, torch.Tensor]]:
    """Consolidated (unsharded) model weights of a checkpoint, in this process, no process group."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    step = _pick_step(uri, step, endpoint_url)
    storage = open_storage(uri, endpoint_url)
    sd = _load_state_dict_from_keys(keys={"model"}, storage_reader=storage.dcp_reader(storage.join(layout.step_dir_name(step))))
    model = sd.get("model")
    if not model:
        raise CheckpointError(f"checkpoint of step {step} has no model weights")
    return step, {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def export_safetensors(uri: str, out: str, step: int | None = None, dtype: str = "fp32", endpoint_url: str = "") -> dict[str, Any]:
    from safetensors.torch import save_file

    step, weights = load_model_weights(uri, step, endpoint_url)
    target = torch.bfloat16 if dtype == "bf16" else torch.float32
    tensors = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
    save_file(tensors, out, metadata={"step": str(step), "source": uri, "format": "pt"})
    return {"step": step, "out": out, "tensors": len(tensors), "dtype": dtype, "parameters": sum(v.numel() for v in tensors.values())}


def main(a) -> int:
    if a.ckpt_cmd == "list":
        rows = list_checkpoints(a.uri, a.endpoint_url)
        print(f"{'step':>10} {'committed':>9} {'valid':>5} {'world':>5} {'bytes':>14}  problem")
        for r in rows:
            print(f"{r['step']:>10} {str(r['committed']):>9} {str(r['valid']):>5} {str(r['world_size'] or '-'):>5} {r['bytes']:>14,}  {r['problem'] or ''}")
        return 0
    if a.ckpt_cmd == "inspect":
        json.dump(inspect_checkpoint(a.uri, a.step, a.endpoint_url), sys.stdout, indent=2)
        print()
        return 0
    if a.ckpt_cmd == "export" and getattr(a, "hf", None):
        from ..config import load_config
        from ..models.hf_export import export_hf

        print(json.dumps(export_hf(a.uri, a.out, load_config(a.hf).model, a.step, a.dtype, a.endpoint_url)))
        return 0
    if a.ckpt_cmd == "export":
        print(json.dumps(export_safetensors(a.uri, a.out, a.step, a.dtype, a.endpoint_url)))
        return 0
    return 2
