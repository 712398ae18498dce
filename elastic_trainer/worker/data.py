"""World-size-invariant data: a memory-mapped token file, a seeded global sample order, and a
global sample cursor.

A *sample* ``i`` is the window ``tokens[i*L : i*L + L + 1]`` (inputs are the first L, targets
the last L). Epoch ``e`` visits samples in ``randperm(n, seed=(seed, e))`` order. Step ``s``
consumes global positions ``cursor .. cursor + G - 1``; rank ``r`` of ``W`` takes a contiguous
balanced slice of that range; every rank runs the same number of micro-batches, padding with
zero-weight micro-batches (all targets ``-100``) where it has fewer samples. So the set of
samples in a step, and the global mean loss over them, never depend on ``W``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError
from ..runtime.sampler import GlobalOrder, micro_steps, rank_slice

IGNORE_INDEX = -100


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


@dataclass
class MicroBatch:
    inputs: torch.Tensor  # [b, L] int64
    targets: torch.Tensor  # [b, L] int64, IGNORE_INDEX where not counted
    n_samples: int  # real samples in it (0 for a padding micro-batch)


class StepBatches:
    """Produces the micro-batches of one rank for the step that starts at a global cursor."""

    def __init__(self, source: TokenFile | None, seed: int, global_batch: int, micro_batch: int, world: int, rank: int):
        self.seed = seed
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.world = world
        self.rank = rank
        self.n_micro = micro_steps(global_batch, world, micro_batch)
        if source is not None:
            self.open(source)

    def open(self, source: TokenFile) -> None:
        """Read from ``source`` (a worker opens it once it knows the run's data view)."""
        self.source = source
        self.order = GlobalOrder(source.n_samples, self.seed)

    def for_cursor(self, cursor: int) -> list[MicroBatch]:
        start, count = rank_slice(self.global_batch, self.world, self.rank)
        ids = [self.order[cursor + start + j] for j in range(count)]
        out = []
        for m in range(self.n_micro):
            chunk = ids[m * self.micro_batch : (m + 1) * self.micro_batch]
            if chunk:
                xs, ys = zip(*(self.source.sample(i) for i in chunk), strict=True)
                out.append(MicroBatch(torch.stack(xs), torch.stack(ys), len(chunk)))
            else:
                x, _ = self.source.sample(self.order[cursor])
                out.append(MicroBatch(x[None], torch.full_like(x[None], IGNORE_INDEX), 0))
        return out


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
