"""The goodput ledger on a week-long log: feed cost per record, ``result()`` cost and memory.

    python bench/ledger_scale.py [--steps 1000000] [--save-every 10]

The supervisor feeds every record of ``events.jsonl`` into one :class:`~elastic_trainer.goodput.Ledger`
and calls ``result()`` at each Prometheus scrape; ``report`` and the auto cadence's lineage do the
same on a whole (or the tail of a) log. Synthetic records, one process: steps of 0.19 s every
0.2 s, a commit record 10 ms after every ``--save-every``-th step. Prints the feed CPU per step,
``result()`` at 1 % of the steps and at the end (their ratio shows whether a scrape's cost grows
with the job), and the ledger's traced memory per step.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parse_with_smoke
from elastic_trainer.goodput import Ledger


def result_seconds(ledger: Ledger, now: float, repeats: int = 20) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        ledger.result(now=now)
    return (time.perf_counter() - t0) / repeats


def feed(steps: int, save_every: int, early_at: int, traced: bool) -> tuple[Ledger, float, float | None, float]:
    """One pass: (ledger, feed CPU, result() seconds at ``early_at``, end time)."""
    ledger, t, early, cpu = Ledger(), 0.0, None, 0.0
    ledger.feed({"event": "launch", "time": 0.0})
    for step in range(1, steps + 1):
        t += 0.2
        c0 = time.process_time()
        ledger.feed({"event": "step", "time": t, "step": step, "step_time_s": 0.19, "world_size": 8})
        if step % save_every == 0:
            ledger.feed({"event": "checkpoint_committed", "time": t + 0.01, "step": step})
        cpu += time.process_time() - c0
        if step == early_at:
            if traced:
                tracemalloc.start()  # what the ledger keeps from here on
            else:
                early = result_seconds(ledger, t + 1)
    return ledger, cpu, early, t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--save-every", type=int, default=10)
    a = parse_with_smoke(ap, ["--steps", "2000"])
    early_at = max(1, a.steps // 100)
    ledger, cpu, early, t = feed(a.steps, a.save_every, early_at, traced=False)
    late = result_seconds(ledger, t + 1)
    g = ledger.result()
    del ledger
    traced, _, _, _ = feed(a.steps, a.save_every, early_at, traced=True)
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_step_mem = mem / (a.steps - early_at)
    print(f"steps {a.steps}, a commit every {a.save_every}: feed {cpu / a.steps * 1e6:.1f} us CPU per step")
    print(
        f"result() at step {early_at}: {early * 1e3:.3f} ms; "
        f"at step {a.steps}: {late * 1e3:.3f} ms; ratio {late / early:.2f}"
    )
    print(
        f"ledger memory kept after step {early_at}: {per_step_mem:.1f} bytes "
        f"per step ({per_step_mem * a.steps / 1e6:.0f} MB at {a.steps} steps)"
    )
    print(
        f"goodput {g.goodput:.4f}, checkpoint stall "
        f"{g.categories['checkpoint_stall']:.1f} s, wall {g.wall_seconds:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
