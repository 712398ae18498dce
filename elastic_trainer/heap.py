"""The Python heap around the control plane's large documents.

Parsing a manifest of 4,096 ranks (2 MB of JSON) or unpickling DCP's ``.metadata`` of 65,000
chunks builds hundreds of thousands of containers, and CPython's cyclic collector runs a full
pass over the whole heap (in a training process: every module, tensor and frame) many times
while they are built: 80% of a manifest's parse time went there (``bench/scale.py``). Those
objects form no cycles to collect, so the collector is paused for the parse.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # parses in progress in any thread
_restore = False  # whether the collector was on when the first of them started


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block (process-wide; nested and concurrent
    blocks share one pause, and the collector is switched back on only if it was on before)."""
    global _depth, _restore
    with _lock:
        if _depth == 0:
            _restore = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _restore:
                gc.enable()
