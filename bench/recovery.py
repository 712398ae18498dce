"""Recovery time after SIGKILL of one worker, broken down from the event log.

    python bench/recovery.py [--config configs/demo-cpu.toml] [--kills 3] [--set k=v ...]

Runs the config under ``elastic-trainer launch`` (run and checkpoint dirs in a scratch dir),
waits for a committed checkpoint, SIGKILLs the highest-ranked worker mid-training, and measures
from the kill to the first step completed after the resume:

* detect      kill → the agent's ``restart`` event (monitor interval)
* stop        ``restart`` → rendezvous starts (stopping the surviving workers, back-off)
* rendezvous  the agent's rendezvous round (``rendezvous.seconds``)
* boot        rendezvous done → worker ``start`` (process spawn, imports, process groups, model)
* load        checkpoint decision + DCP load (``start`` → ``resume``; ``load_seconds`` is DCP)
* first step  ``resume`` → the first ``step`` event

Prints one JSON line per kill and a summary (median) as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import runs  # noqa: E402

PHASES = ("detect", "stop", "rendezvous", "boot", "load", "first_step")


def ensure_data(path: Path) -> None:
    if not path.exists():
        subprocess.run([*runs.CLI, "data", "build", "--out", str(path)], check=True, cwd=REPO, env=runs.env_for_tests())


def breakdown(events: list[dict], killed_at: float) -> dict:
    after = [e for e in events if e["time"] >= killed_at]
    first = lambda name: next(e for e in after if e["event"] == name)  # noqa: E731
    restart, rdzv, start, resume = first("restart"), first("rendezvous"), first("start"), first("resume")
    step = next(e for e in after if e["event"] == "step" and e["time"] > resume["time"])
    last_before = max(e["step"] for e in events if e["event"] == "step" and e["time"] < killed_at)
    rdzv_begin = rdzv["time"] - rdzv["seconds"]
    return {
        "total": step["time"] - killed_at,
        "detect": restart["time"] - killed_at,
        "stop": rdzv_begin - restart["time"],
        "rendezvous": rdzv["seconds"],
        "boot": start["time"] - rdzv["time"],
        "load": resume["time"] - start["time"],
        "dcp_load": resume["load_seconds"],
        "first_step": step["time"] - resume["time"],
        "resumed_from": resume["step"],
        "lost_steps": last_before - resume["step"],
        "backoff": restart["backoff_seconds"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs/demo-cpu.toml"))
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json-out", help="write the results here")
    a = ap.parse_args()
    ensure_data(REPO / "runs/data/demo.bin")
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    run_dir = work / "run"
    args = ["--set", f"run.dir={run_dir}", "--set", f"checkpoint.dir={run_dir / 'ckpt'}", "--set", "train.steps=100000",
            "--max-restarts", str(a.kills + 2)]
    for o in a.overrides:
        args += ["--set", o]
    log = open(work / "launch.log", "ab")
    proc = subprocess.Popen([*runs.CLI, "launch", a.config, *args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=runs.env_for_tests(), start_new_session=True)
    results = []
    try:
        for i in range(a.kills):
            since = time.time()
            c = runs.wait_event(run_dir, "checkpoint_committed", 600, proc, where=lambda r: r["time"] > since)
            # Kill a few steps after a commit (the typical case is mid-interval; lost work is reported apart).
            runs.wait_event(run_dir, "step", 300, proc, where=lambda r: r["step"] >= c["step"] + 3)
            victim = runs.worker_pids(proc.pid)[-1]
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            runs.wait_event(run_dir, "resume", 300, proc, where=lambda r: r["time"] > killed_at)
            runs.wait_event(run_dir, "step", 300, proc, where=lambda r: r["time"] > killed_at and r["step"] > 0 and any(
                e["event"] == "resume" and killed_at < e["time"] < r["time"] for e in runs.read_events(run_dir, "resume")))
            res = breakdown(runs.read_events(run_dir), killed_at)
            results.append(res)
            print(json.dumps({"kill": i + 1, **{k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}}), flush=True)
    finally:
        runs.stop_gracefully(proc)
    steady = [e["step_time_s"] for e in runs.read_events(run_dir, "step")[5:]]
    med = {k: statistics.median(r[k] for r in results) for k in ("total", *PHASES, "dcp_load")}
    print("\n| phase | median seconds |\n|---|---|")
    for k in (*PHASES, "total"):
        print(f"| {k} | {med[k]:.2f} |")
    print(f"\nsteady step time {statistics.median(steady):.3f}s; {a.kills} kills; logs in {work}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"kills": results, "median": med, "step_time_s": statistics.median(steady)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
