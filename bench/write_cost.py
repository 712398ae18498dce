"""CPU-seconds per GB a DCP checkpoint write costs, per writer variant.

    python bench/write_cost.py [--mb 1024] [--tensors 32] [--rounds 3] [--json-out F]

One process, no process group (what one rank's upload thread does), local temp dir. Each variant
writes the same ``--mb`` MB of float32 tensors with ``dcp.save``; measured: CPU time of the whole
process (all threads, user + system: serialisation, hashing, the page-cache copy, fsync) and wall
time, per GB written. Rounds interleave the variants so all see the same load.

* ``torch-default``: torch's own ``FileSystemWriter`` (through the page cache), torch.save's zip
  CRC32s on;
* ``ours``: the manager's writer, ``integrity.ChecksummedWriter(...)`` (CRC32s off, XXH3 of every
  byte), shard files written around the page cache (``checkpoint.direct_io``, ``storage.direct``);
* ``ours-buffered``: the same through the page cache, with early writeback (``checkpoint.direct_io
  = false``);
* ``ours-threads2``: ``ours`` with ``thread_count=2`` (two files per rank, two writer threads);
* ``ours-no-writeback``: ``ours-buffered`` without early writeback (``storage.writeback``: the disk
  starts only at the final fsync); ``ours-buffered``' wall ÷ this one's is what early writeback
  saves of a write + fsync;
* ``no-crc-no-hash``: CRC32s off and no checksums (what the serialisation and file writes
  alone cost: the floor for any checksummed variant).

Every checkpoint written is re-read with torch's ``format_utils.dcp_to_torch_save`` once (a plain
DCP checkpoint) and compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import loadavg, machine_info, median, parse_with_smoke, table

VARIANTS = ["torch-default", "ours", "ours-buffered", "ours-threads2", "ours-no-writeback", "no-crc-no-hash"]
BUFFERED = {"torch-default", "ours-buffered", "ours-no-writeback", "no-crc-no-hash"}  # through the page cache


def _writer(variant: str, storage, buffered, path: str):
    """``storage``: the root as the manager opens it (direct I/O); ``buffered``: the same root
    with ``checkpoint.direct_io = false``."""
    from elastic_trainer.checkpoint import integrity

    w = (buffered if variant in BUFFERED else storage).dcp.writer(path)
    if variant == "torch-default":
        return w
    if variant == "ours-threads2":
        w.thread_count = 2
    if variant == "no-crc-no-hash":
        return _NoCrc(w)
    return integrity.ChecksummedWriter(w)


class _NoCrc:
    """A writer proxy that turns torch.save's CRC32s off while it writes, nothing else."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def write_data(self, plan, planner):
        import torch

        prev = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            fut = self._inner.write_data(plan, planner)
            fut.wait()
            return fut
        finally:
            torch.serialization.set_crc32_options(prev)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json-out")
    a = parse_with_smoke(ap, ["--mb", "8", "--tensors", "2", "--rounds", "1"])

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from elastic_trainer.storage import writeback
    from elastic_trainer.storage.fs import open_storage

    libc_call = writeback.sync_file_range  # switched off for one variant

    info = machine_info()
    info["loadavg_start"] = loadavg()
    rows_per = a.mb * 2**20 // 4 // a.tensors // 1024
    state = {f"t{i}": torch.randn(rows_per, 1024) for i in range(a.tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    work = tempfile.mkdtemp(prefix="bench-write-cost-", dir=a.workdir)
    storage = open_storage(work)
    buffered = open_storage(work, direct_io=False)
    cpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    checked = set()
    try:
        for r in range(a.rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for v in order:
                path = storage.join(f"{v}-{r}")
                storage.makedirs(path)
                w = _writer(v, storage, buffered, path)
                writeback.sync_file_range = None if v == "ours-no-writeback" else libc_call
                c0, t0 = time.process_time(), time.monotonic()
                dcp.save(state, storage_writer=w, no_dist=True)
                writeback.sync_file_range = libc_call
                cpu.setdefault(v, []).append(time.process_time() - c0)
                wall.setdefault(v, []).append(time.monotonic() - t0)
                if v not in checked:
                    out = os.path.join(work, f"{v}.pt")
                    dcp_to_torch_save(path, out)
                    back = torch.load(out, weights_only=True)
                    assert all(torch.equal(back[k], state[k]) for k in state), v
                    os.remove(out)
                    checked.add(v)
                storage.delete_tree(path)
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{v} {cpu[v][-1]:.2f} CPU-s" for v in order), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = loadavg()
    gb = nbytes / 1e9
    print()
    print(
        f"machine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}; "
        f"load average start {info['loadavg_start'][0]:.2f}, end {info['loadavg_end'][0]:.2f}"
    )
    print(
        f"payload: {nbytes / 1e6:.0f} MB in {a.tensors} tensors, "
        f"local disk; {a.rounds} rounds; command: python {' '.join(sys.argv)}"
    )
    base = median(cpu["torch-default"]) / gb
    rows = [
        [
            v,
            f"{median(cpu[v]) / gb:.3f}",
            ", ".join(f"{x / gb:.3f}" for x in cpu[v]),
            f"{median(cpu[v]) / gb / base:.2f}",
            f"{median(wall[v]) / gb:.3f}",
        ]
        for v in VARIANTS
    ]
    print(table(["writer", "CPU-s per GB (median)", "samples", "÷ torch default", "wall s per GB"], rows))
    for what, num, den, src in (
        ("direct I/O: CPU, ours ÷ ours-buffered", "ours", "ours-buffered", cpu),
        ("direct I/O: write + fsync wall, ours ÷ ours-buffered", "ours", "ours-buffered", wall),
        (
            "early writeback: write + fsync wall, ours-buffered ÷ ours-no-writeback",
            "ours-buffered",
            "ours-no-writeback",
            wall,
        ),
    ):
        paired = [x / y for x, y in zip(src[num], src[den], strict=True)]
        print(f"{what} per round {', '.join(f'{x:.2f}' for x in paired)} (median {median(paired):.2f})")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"cpu": cpu, "wall": wall, "bytes": nbytes, "info": info}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
