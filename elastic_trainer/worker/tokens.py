"""Token files: a flat binary file of token ids, memory-mapped (:class:`TokenFile`), checked
against the vocabulary, and built from text (:func:`build_token_file`).

Needs numpy and torch only: the supervisor opens data sources with it before any worker starts.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import ConfigError


class TokenFile:
    """A flat binary file of token ids, memory-mapped read-only.

    Every token id is checked against ``vocab_size`` (a chunked max over the whole file; pass
    ``max_id`` when it is already known, e.g. cached, to skip the scan)."""

    def __init__(
        self, path: str, dtype: str, seq_len: int, vocab_size: int, max_id: int | None = None, key: str = "data.path"
    ):
        if not os.path.exists(path):
            raise ConfigError(key, f"no such token file: {path} (build one with 'elastic-trainer data build')")
        itemsize = np.dtype(dtype).itemsize
        size = os.path.getsize(path)
        if size == 0:
            raise ConfigError(key, f"{path} is empty: no tokens to train on")
        if size % itemsize:
            raise ConfigError("data.dtype", f"{path} has {size} bytes, not a multiple of {dtype} ({itemsize} bytes)")
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.seq_len = seq_len
        self.n_samples = (len(self.tokens) - 1) // seq_len
        if self.n_samples < 1:
            raise ConfigError(
                key, f"{path} has {len(self.tokens)} tokens: fewer than one sample of model.seq_len={seq_len}"
            )
        self.max_id = max_id if max_id is not None else scan_max(self.tokens, vocab_size, path)
        if self.max_id >= vocab_size:
            raise ConfigError(
                "model.vocab_size", f"token id {self.max_id} in {path} is >= model.vocab_size={vocab_size}"
            )

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


SCAN_CHUNK = 1 << 24  # tokens per np.max call: bounded memory, numpy speed


def scan_max(tokens: np.ndarray, vocab_size: int, path: str, chunk: int = SCAN_CHUNK) -> int:
    """The largest token id in ``tokens``; stops at the first chunk holding an id >=
    ``vocab_size`` and raises ConfigError naming ``model.vocab_size`` and that id's position."""
    top = -1
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        m = int(part.max())
        if m >= vocab_size:
            pos = start + int(np.argmax(part >= vocab_size))
            raise ConfigError(
                "model.vocab_size",
                f"token id {int(part[pos - start])} at token {pos} of {path} is >= model.vocab_size={vocab_size}",
            )
        top = max(top, m)
    return top


def unique_tmp(path: str) -> str:
    """A temporary name next to ``path`` that no other process on any node uses (host, pid,
    random), for an atomic ``os.replace`` into ``path`` in a directory nodes may share."""
    import socket
    import uuid

    return f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def build_token_file(texts: list[str], out_path: str) -> dict:
    """Byte-level tokenisation (vocab 256) of text files into a uint16 token file. Returns stats."""
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    total = 0
    tmp = unique_tmp(out_path)
    with open(tmp, "wb") as f:
        for path in texts:
            with open(path, "rb") as src:
                data = np.frombuffer(src.read(), dtype=np.uint8).astype(np.uint16)
            f.write(data.tobytes())
            total += len(data)
    os.replace(tmp, out_path)
    return {"path": out_path, "tokens": total, "dtype": "uint16", "vocab_size": 256, "files": len(texts)}


def default_demo_texts(limit_bytes: int = 8 << 20) -> list[str]:
    """Text that exists on every machine with Python: the standard library's own sources."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__", "idlelib")
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                p = os.path.join(dirpath, name)
                files.append(p)
                total += os.path.getsize(p)
                if total >= limit_bytes:
                    return files
    return files
