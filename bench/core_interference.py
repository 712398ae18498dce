"""How much work on the other core slows a single-threaded torch loop pinned to this one.

    python bench/core_interference.py [--repeats 2] [--inner 15]

Pins itself to CPU 0 (one intra-op thread) and times a fixed loop of small matmuls and layer
norms (the demo's kind of work) while CPU 1 runs, in turn: nothing; a pure Python busy loop (no
memory traffic); a 64 MB ``copy_`` loop (memory bandwidth, what staging does); ``torch.save``
into memory + XXH3 (what a checkpoint writer does). Loads are started with ``taskset -c 1``
and alternate per repeat. Prints each load's median loop time ÷ idle: whether "one core left
free for the writer" is free on this machine (shared caches, memory bandwidth, SMT siblings).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parse_with_smoke

LOADS = {
    "idle": None,
    "python busy loop (no memory traffic)": "while True: pass",
    "copy_ of 64 MB in a loop": "import torch; torch.set_num_threads(1); a=torch.empty(16<<20); "
    "b=torch.empty(16<<20)\nwhile True: a.copy_(b)",
    "torch.save to memory + XXH3": "import io,torch,xxhash; torch.set_num_threads(1); t=torch.randn(2<<20)\n"
    "while True:\n  buf=io.BytesIO(); torch.save(t, buf); xxhash.xxh3_64(buf.getbuffer()).intdigest()",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--inner", type=int, default=15, help="loops timed per sample (median)")
    a = parse_with_smoke(ap, ["--repeats", "1", "--inner", "1"])
    import torch

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})
    x, y, z = torch.randn(256, 256), torch.randn(256, 256), torch.randn(64, 128, 128)

    def loop() -> float:
        t = time.perf_counter()
        for _ in range(200):
            (x @ y).relu_()
            torch.nn.functional.layer_norm(z, (128,))
        return time.perf_counter() - t

    loop()
    res: dict[str, list[float]] = {}
    for rep in range(a.repeats):
        names = list(LOADS) if rep % 2 == 0 else list(reversed(LOADS))
        for name in names:
            p = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", LOADS[name]]) if LOADS[name] else None
            try:
                if p:
                    time.sleep(1.0)
                res.setdefault(name, []).append(statistics.median(loop() for _ in range(a.inner)))
            finally:
                if p:
                    p.kill()
                    p.wait()
    base = statistics.median(res["idle"])
    print(f"command: python {' '.join(sys.argv)}; load average {os.getloadavg()[0]:.2f}")
    print("| load on CPU 1 | loop ms (median) | ÷ idle | samples ms |\n|---|---|---|---|")
    for name, v in res.items():
        print(
            f"| {name} | {statistics.median(v) * 1000:.1f} | "
            f"{statistics.median(v) / base:.3f} | {', '.join(f'{s * 1000:.0f}' for s in v)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
