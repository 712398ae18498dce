"""What writing a local copy into a new file costs, against rewriting the file a retired copy left.

    python bench/shm_rewrite.py [--mb 11.5] [--rounds 5] [--writes 40] [--dir /dev/shm] [--json-out F]

One process. Per round, in alternating order so both see the same load, ``--writes`` times each:

* ``new file``: create a file in ``--dir``, write ``--mb`` MB, fsync, delete it (what the local
  tier did per copy: a new copy's file, and the retired copy's deleted);
* ``rewrite``: open one existing file of that size, write the same bytes over it from offset 0,
  cut it to size, fsync (what the local tier does now: the next copy written into the retired
  copy's data file, kept as the rank's spare).

On tmpfs (``/dev/shm``, Kubernetes' ``emptyDir: {medium: Memory}``) a new file's every page is
allocated and zeroed by the kernel and freed again when the file goes; a rewrite reuses them.
Printed: milliseconds per write (median over rounds), and rewrite ÷ new file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import loadavg, machine_info, median, parse_with_smoke, table


def _new_file(d: str, data: bytes, i: int) -> None:
    path = os.path.join(d, f"copy-{i}")
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.remove(path)


def _rewrite(path: str, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))
        f.flush()
        os.fsync(f.fileno())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=11.5, help="size of one copy (the demo's state: 11.5 MB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--writes", type=int, default=40, help="writes per variant and round")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--json-out")
    a = parse_with_smoke(ap, ["--mb", "0.5", "--rounds", "1", "--writes", "3"])
    data = os.urandom(int(a.mb * 1e6))
    print(json.dumps({"machine": machine_info(), "loadavg": loadavg(), "args": vars(a)}))
    per: dict[str, list[float]] = {"new file": [], "rewrite": []}
    with tempfile.TemporaryDirectory(prefix="shm-rewrite-", dir=a.dir) as d:
        spare = os.path.join(d, "spare")
        with open(spare, "wb") as f:
            f.write(data)
        for r in range(a.rounds):
            order = ["new file", "rewrite"] if r % 2 == 0 else ["rewrite", "new file"]
            for v in order:
                t0 = time.perf_counter()
                for i in range(a.writes):
                    _new_file(d, data, i) if v == "new file" else _rewrite(spare, data)
                per[v].append((time.perf_counter() - t0) / a.writes * 1000)
    ms = {v: median(xs) for v, xs in per.items()}
    ratio = ms["rewrite"] / ms["new file"] if ms["new file"] > 0 else float("nan")
    rows = [[v, f"{ms[v]:.2f}", ", ".join(f"{x:.2f}" for x in per[v])] for v in per]
    print(table(["variant", "ms per write (median)", "per round"], rows))
    print(f"rewrite ÷ new file: {ratio:.2f} ({a.mb} MB in {a.dir})")
    result = {"ms": ms, "per_round": per, "ratio": ratio, "loadavg_end": loadavg()}
    print(json.dumps(result))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
