"""Cost of checkpoint integrity, side by side in one run: checksummed vs plain DCP.

For a state of ``--mb`` MiB (fp32 tensors, the shape mix of a transformer + AdamW), alternating
rounds in one process (world 1, gloo), local disk:

* save CPU: ``time.process_time()`` of a synchronous ``dcp.save`` with our checksummed writer vs
  the same writer class without hashing (torch's ``FileSystemWriter``, zip CRC32 off as in ours);
* training stall: the time ``dcp.async_save`` blocks the caller (hashing runs in the upload
  thread, so this should not move);
* load time: ``dcp.load`` through the verifying reader vs torch's plain ``FileSystemReader``.

Prints one JSON line per round and a summary with the ratios BENCHMARKS.md reports.

    python bench/integrity.py --mb 512 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parse_with_smoke
from elastic_trainer.checkpoint import integrity, layout


def make_state(mb: int) -> dict:
    n = mb * (1 << 20) // 4 // 3  # params + exp_avg + exp_avg_sq
    dim = 1024
    rows = max(1, n // dim)
    blocks = 8
    per = max(1, rows // blocks)
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.w": torch.randn(per, dim, generator=g) for i in range(blocks)}
    optim = {f"{k}.{m}": torch.randn(per, dim, generator=g) for k in model for m in ("exp_avg", "exp_avg_sq")}
    return {"model": model, "optim": optim, "step": 7}


def writer(path: str, checked: bool):
    w = FileSystemWriter(path, single_file_per_rank=True, sync_files=False, thread_count=1)
    return integrity.ChecksummedWriter(w) if checked else w


def save_cpu(state, path, checked) -> float:
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # ours turns it off too: compare hashing alone
    try:
        t = time.process_time()
        dcp.save(state, storage_writer=writer(path, checked))
        return time.process_time() - t
    finally:
        torch.serialization.set_crc32_options(previous)


def async_stall(state, path, checked) -> float:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False
        )
    )
    t = time.perf_counter()
    resp = dcp.async_save(state, storage_writer=writer(path, checked), async_stager=stager)
    blocked = time.perf_counter() - t
    resp.upload_completion.result()
    stager.close()
    return blocked


def load_time(state, path, checked) -> float:
    target = {
        k: ({kk: torch.empty_like(vv) for kk, vv in v.items()} if isinstance(v, dict) else v) for k, v in state.items()
    }
    reader = FileSystemReader(path)
    if checked:
        checks = layout.Checks.from_manifest({"files": json.load(open(os.path.join(path, layout.CHECKSUMS)))["files"]})
        reader = integrity.verifying(reader, checks)
    t = time.perf_counter()
    dcp.load(target, storage_reader=reader)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    a = parse_with_smoke(ap, ["--mb", "4", "--rounds", "1"])
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    state = make_state(a.mb)
    root = tempfile.mkdtemp(prefix="bench-integrity-", dir=a.dir)
    rows = []
    try:
        for r in range(a.rounds):
            row = {"round": r}
            for checked in (False, True) if r % 2 == 0 else (True, False):  # alternate the order
                tag = "checked" if checked else "plain"
                p = os.path.join(root, f"{tag}-{r}")
                row[f"save_cpu_{tag}"] = save_cpu(state, p, checked)
                row[f"load_{tag}"] = load_time(state, p if checked else p, checked)
                shutil.rmtree(p)
                row[f"stall_{tag}"] = async_stall(state, p, checked)
                shutil.rmtree(p)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            rows.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    summary = {
        "state_mb": a.mb,
        "rounds": a.rounds,
        "extra_save_cpu_ratio": round((med["save_cpu_checked"] - med["save_cpu_plain"]) / med["save_cpu_plain"], 4),
        "stall_checked_s": round(med["stall_checked"], 4),
        "stall_plain_s": round(med["stall_plain"], 4),
        "load_ratio": round(med["load_checked"] / med["load_plain"], 4),
        "medians": {k: round(v, 4) for k, v in med.items()},
    }
    print(json.dumps({"summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
