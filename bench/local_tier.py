"""Local-tier load ÷ object-store load of the same checkpoint, through the checkpoint manager.

    python bench/local_tier.py [--mb 512] [--tensors 16] [--rounds 3] [--local-dir /dev/shm/...] [--json-out F]

Starts SeaweedFS on 127.0.0.1 (as bench/s3_throughput.py does). One process, no process group
(what one rank does): a ``CheckpointManager`` over ``--mb`` MB of float32 tensors with
``checkpoint.dir`` on S3 and ``checkpoint.local_dir`` (default: a fresh directory under
``/dev/shm`` when it exists, else the temp dir), saving one step to both tiers (``durable``).
Then, per round, in alternating order so both see the same machine load:

* local:  a fresh manager's ``load()`` with the local tier (``resume.tier == "local"``; the
          per-rank copy, every byte verified against its manifest);
* remote: a fresh manager's ``load()`` without it (``checkpoint.dir`` on S3, every byte verified);

and the write side: a local-only save (``remote_every`` not due) vs a save to S3, both blocking.
Every load is checked bit for bit. Prints medians and local ÷ remote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import loadavg, median, parse_with_smoke, table
from bench.s3_throughput import setup


class _Tensors:
    """A Stateful of plain tensors (what one rank's shard of a model looks like to DCP)."""

    def __init__(self, tensors):
        self.t = tensors

    def state_dict(self):
        return dict(self.t)

    def load_state_dict(self, sd):
        for k, v in sd.items():
            self.t[k].copy_(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local-dir", default="")
    ap.add_argument("--json-out")
    a = parse_with_smoke(ap, ["--mb", "4", "--tensors", "2", "--rounds", "1"])

    import torch

    from elastic_trainer.checkpoint.manager import CheckpointManager
    from elastic_trainer.config import config_from_dict
    from elastic_trainer.storage.fs import open_storage
    from tests.fixtures.procs import stop_process

    shm = Path("/dev/shm")
    local_dir = a.local_dir or tempfile.mkdtemp(
        prefix="bench-lt-local-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    )
    info, root, server, proc, state, nbytes = setup("bench-lt-", a.mb, a.tensors)
    samples: dict[str, list[float]] = {}
    try:
        bucket = server.make_bucket("bench")
        uri = f"s3://{bucket}/run"
        base = config_from_dict(
            {"checkpoint": {"dir": uri, "local_dir": local_dir, "remote_every": 1000, "mode": "sync"}}
        ).checkpoint

        def manager(target, local: bool) -> CheckpointManager:
            cfg = base if local else dataclasses.replace(base, local_dir="", remote_every=1)
            return CheckpointManager(
                cfg,
                open_storage(uri),
                {"m": _Tensors(target)},
                rank=0,
                world_size=1,
                mesh_shape=[1],
                group=None,
                fingerprint="bench",
                launch_id="bench-local-tier",
            )

        m = manager(state, local=True)
        m.load()
        m.save(1, durable=True)
        m.finish()
        for r in range(a.rounds):
            # the write side: a local-only save (remote_every not due) and a save to S3
            t0 = time.monotonic()
            m.save(100 + r)
            m.finish()
            samples.setdefault("save: local only", []).append(time.monotonic() - t0)
            t0 = time.monotonic()
            m.save(200 + r, durable=True)
            m.finish()
            samples.setdefault("save: local + S3", []).append(time.monotonic() - t0)
        m.close()
        step = 200 + a.rounds - 1
        for r in range(a.rounds):
            for tier in ("local", "remote") if r % 2 == 0 else ("remote", "local"):
                target = {k: torch.empty_like(t) for k, t in state.items()}
                mm = manager(target, local=tier == "local")
                t0 = time.monotonic()
                got = mm.load()
                samples.setdefault(f"load: {tier}", []).append(time.monotonic() - t0)
                assert got is not None and got.tier == tier and got.step == step, (tier, got)
                assert all(torch.equal(target[k], state[k]) for k in state)
                mm.close()
                del target
            print(
                f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {x[-1]:.2f}s" for k, x in samples.items()), flush=True
            )
    finally:
        stop_process(proc, 10)
        shutil.rmtree(root, ignore_errors=True)
        if not a.local_dir:
            shutil.rmtree(local_dir, ignore_errors=True)
    info["loadavg_end"] = loadavg()
    med = {k: median(v) for k, v in samples.items()}
    print()
    print(
        f"machine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}; "
        f"load average start {info['loadavg_start'][0]:.2f}, end {info['loadavg_end'][0]:.2f}"
    )
    print(
        f"checkpoint: {nbytes / 1e6:.0f} MB in {a.tensors} tensors, "
        "one rank; local tier in "
        f"{local_dir if a.local_dir else ('/dev/shm' if local_dir.startswith('/dev/shm') else 'the temp dir')}; "
        f"medians of {a.rounds} rounds"
    )
    print(table(["measure", "seconds", "MB/s"], [[k, f"{v:.3f}", f"{nbytes / 1e6 / v:.0f}"] for k, v in med.items()]))
    ratios = {
        "load local ÷ load remote": med["load: local"] / med["load: remote"],
        "save local-only ÷ save local + S3": med["save: local only"] / med["save: local + S3"],
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    if a.json_out:
        Path(a.json_out).write_text(
            json.dumps({"machine": info, "bytes": nbytes, "samples": samples, "ratios": ratios}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
