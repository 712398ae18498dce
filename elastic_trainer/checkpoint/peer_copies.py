"""This node's own copies for the peer tier: its committed local-tier copies of one job, as its
holder serves them to other nodes (:class:`..storage.peer.Served`) and as its ranks read them."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

from . import layout
from .local_tier import copy_dir

_RANK_DIR_RE = re.compile(r"^rank-(\d+)-of-(\d+)$")
DISK = "disk"  # a copy's location: this node's checkpoint.local_dir (else a holder's address)


class NodeCopies:
    """This node's committed local-tier copies of one job (``<local_dir>/<job>``)."""

    def __init__(self, root: str):
        self.root = root

    def _dirs(self) -> Iterator[tuple[str, int, int, int]]:
        """``(directory, step, source rank, world size)`` of every rank directory under the root."""
        for e in _listdir(self.root):
            base = os.path.join(self.root, e)
            for s in _listdir(base):
                step = layout.parse_step_dir(s)
                for r in _listdir(os.path.join(base, s)) if step is not None else ():
                    m = _RANK_DIR_RE.match(r)
                    if m and step is not None:
                        yield os.path.join(base, s, r), step, int(m.group(1)), int(m.group(2))

    def inventory(self) -> list[dict[str, Any]]:
        """The copies whose manifest is written: ``{epoch, step, src, world, manifest}`` each."""
        out = []
        for d, step, src, world in self._dirs():
            try:
                with open(os.path.join(d, layout.MANIFEST)) as f:
                    text = f.read()
                epoch = json.loads(text).get("epoch", "")
            except (OSError, ValueError, AttributeError):
                continue  # uncommitted or unreadable: not offered
            out.append({"epoch": epoch, "step": step, "src": src, "world": world, "manifest": text})
        return out

    def path(self, epoch: str, step: int, src: int, world: int) -> str:
        return copy_dir(self.root, epoch, step, src, world)

    def read(
        self, epoch: str, step: int, src: int, world: int, name: str, offset: int, length: int
    ) -> tuple[bytes, int] | None:
        """``(the bytes at offset, at most length of them; the file's size)``, or None."""
        if os.path.basename(name) != name or name in ("", ".", ".."):
            return None
        try:
            with open(os.path.join(self.path(epoch, step, src, world), name), "rb") as f:
                f.seek(offset)
                return f.read(length), os.fstat(f.fileno()).st_size
        except OSError:
            return None

    def drop(self, epoch: str, step: int, src: int, world: int) -> None:
        shutil.rmtree(self.path(epoch, step, src, world), ignore_errors=True)


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
