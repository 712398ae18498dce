"""Shared helpers for the benchmarks: machine facts, load average, medians, Markdown tables."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


def machine_info() -> dict:
    import torch

    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_total_gib": round(mem / 2**30, 1),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def record_saves() -> list:
    """From now on in this process, every save a checkpoint manager starts (or skips because the
    previous one is still writing): its ``SaveStats``, as the manager's ``save`` returns them (the
    manager adds the staging wait to them later). A save that was a no-op (the step already
    committed, or already in the local tier) is left out. Returns the list it fills."""
    from elastic_trainer.checkpoint.manager import CheckpointManager

    recorded: list = []
    save = CheckpointManager.save

    def recording(self, *args, **kwargs):
        stats = save(self, *args, **kwargs)
        if not stats.skipped.startswith("already "):
            recorded.append(stats)
        return stats

    CheckpointManager.save = recording
    return recorded


def vm_hwm_bytes(pid: int) -> int | None:
    """Peak resident set size of a live process (``VmHWM`` in /proc/PID/status), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def parse_with_smoke(ap, tiny: list[str], argv: list[str] | None = None):
    """``ap.parse_args`` with a ``--smoke`` flag: tiny sizes, one repeat, seconds — it proves the
    script still runs (CI runs every script so), not a figure. ``tiny``: the flags it stands for,
    put before the command line's own (which still win)."""
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: check that the script runs (CI)")
    argv = sys.argv[1:] if argv is None else list(argv)
    return ap.parse_args([*tiny, *argv] if "--smoke" in argv else argv)


# a tiny demo model for smoke runs of the scripts that launch configs/demo-cpu.toml
TINY_DEMO = [
    *("--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2", "--set", "model.seq_len=32"),
    *(
        "--set",
        "train.global_batch_size=4",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "checkpoint.interval_steps=2",
    ),
]
