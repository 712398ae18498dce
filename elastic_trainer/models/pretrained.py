"""Start from pretrained weights: ``model.init_from`` (a local Hugging Face folder with
``*.safetensors``, or one ``.safetensors`` file).

On a fresh start (no checkpoint to resume), after the model is sharded, materialised and
deterministically initialised, every parameter (and persistent buffer) that the files hold is
loaded into its sharded DTensor with ``torch.distributed.checkpoint``'s
``HuggingFaceStorageReader``: each rank reads only the slices of its own shards from the
memory-mapped safetensors files, so the full model never exists on one rank. Tensor names are
the model's own (``model.state_dict()`` keys, which FSDP2 keeps); a tied parameter needs only
one of its names in the files (``lm_head.weight`` tied to ``model.embed_tokens.weight``).
Dtypes are converted to the model's (fp32 master weights). A resume loads the checkpoint
instead, so a fine-tune's checkpoint resumes like any other.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Mapping
from typing import cast

from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError

logger = logging.getLogger(__name__)

KEY = "model.init_from"
SUFFIX = ".safetensors"


def safetensors_files(path: str, key: str = KEY) -> list[str]:
    """The ``.safetensors`` files ``path`` names (the file, or every one in the folder)."""
    if os.path.isfile(path):
        if not path.endswith(SUFFIX):
            raise ConfigError(
                key, f"{path} is not a {SUFFIX} file (give the file or a Hugging Face folder holding {SUFFIX} files)"
            )
        return [os.path.abspath(path)]
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(os.path.abspath(path), f"*{SUFFIX}")))
        if not files:
            raise ConfigError(
                key, f"no {SUFFIX} files in {path} (only safetensors weights are read; convert pytorch_model.bin first)"
            )
        return files
    raise ConfigError(key, f"no such file or directory: {path} (nothing is downloaded: give a local folder or file)")


def file_shapes(files: list[str], key: str = KEY) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers (no tensor data read)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError(
            key,
            "reading safetensors needs the safetensors package: "
            "install the hf extra: pip install -e '.[hf]' in the elastic-trainer clone",
        ) from None
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    out[name] = tuple(st.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - any unreadable file is a config problem
            raise ConfigError(key, f"cannot read {f}: {e}") from None
    return out


def plan(
    params: Mapping[str, tuple[int, ...]],
    tied: list[list[str]],
    buffers: Mapping[str, tuple[int, ...]],
    available: Mapping[str, tuple[int, ...]],
    key: str = KEY,
) -> list[str]:
    """Names to load (pure). ``params``: every parameter name (tied ones under each name) ->
    full shape; ``tied``: groups of names sharing one parameter; ``buffers``: persistent
    buffers (loaded when present); ``available``: what the files hold. Every parameter must be
    there (one name of a tied group suffices) with the same shape."""
    group_of = {n: g for g in tied for n in g}
    missing, wrong, names = [], [], []
    for name, shape in params.items():
        group = group_of.get(name, [name])
        if name != next((n for n in group if n in available), group[0]):
            continue  # another name of this tied parameter is the one loaded (or reported)
        if name not in available:
            missing.append(name)
        elif tuple(available[name]) != tuple(shape):
            wrong.append(f"{name} {tuple(available[name])} vs model {tuple(shape)}")
        else:
            names.append(name)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConfigError(
            key,
            f"the pretrained weights have no {', '.join(missing[:5])}{more}: "
            "they are not for this model (names must match the model's state_dict)",
        )
    if wrong:
        raise ConfigError(key, f"shape mismatch: {'; '.join(wrong[:5])}")
    names += [n for n, shape in buffers.items() if n in available and tuple(available[n]) == tuple(shape)]
    return names


def _model_names(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], list[list[str]], dict[str, tuple[int, ...]]]:
    params: dict[str, tuple[int, ...]] = {}
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params[name] = tuple(p.shape)
        by_id.setdefault(id(p), []).append(name)
    tied = [g for g in by_id.values() if len(g) > 1]
    state = model.state_dict(keep_vars=True)
    buffers = {n: tuple(t.shape) for n, t in state.items() if n not in params}
    return params, tied, buffers


def check_init_from(path: str, model: nn.Module) -> None:
    """Supervisor-side check before any worker starts: the files exist and hold every parameter
    of ``model`` (built on the meta device) with its shape."""
    plan(*_model_names(model), file_shapes(safetensors_files(path)))


class _OnlyFiles:
    """The reader's filesystem, listing only the chosen files (a single file given by path)."""

    def __init__(self, fs, files: list[str]):
        self._fs, self._files = fs, files

    def ls(self, path):
        return list(self._files)

    def __getattr__(self, name):
        return getattr(self._fs, name)


def load_pretrained(model: nn.Module, path: str) -> dict:
    """Load ``path``'s weights into the (sharded) model in place. All ranks (a DCP load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    t0 = time.monotonic()
    files = safetensors_files(path)
    names = plan(*_model_names(model), file_shapes(files))
    state = model.state_dict()
    wanted = {n: state[n] for n in names}
    reader = HuggingFaceStorageReader(os.path.dirname(files[0]))
    reader.fs = cast(FileSystem, _OnlyFiles(reader.fs, files))  # a FileSystem but for ls
    dcp.load(wanted, storage_reader=reader)
    return {"path": path, "files": len(files), "tensors": len(names), "seconds": round(time.monotonic() - t0, 4)}


def init_from_pretrained(cfg: ModelConfig, model: nn.Module, events, rank: int) -> dict | None:
    """A fresh start's ``model.init_from``: load the weights, log and record an ``init_from`` event."""
    if not cfg.init_from:
        return None
    stats = load_pretrained(model, cfg.init_from)
    events.emit("init_from", **stats)
    if rank == 0:
        logger.info(
            "initialised from %s: %d tensors from %d file(s) in %.2fs",
            cfg.init_from,
            stats["tensors"],
            stats["files"],
            stats["seconds"],
        )
    return stats
