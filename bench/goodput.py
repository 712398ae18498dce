"""Goodput under periodic SIGKILLs.

    python bench/goodput.py [--minutes 10] [--kill-every 120] [--config configs/demo-cpu.toml] [--set k=v ...]

Runs the config for ``--minutes`` under ``elastic-trainer launch``, SIGKILLs one worker (a
random rank, seeded) every ``--kill-every`` seconds, then stops the job with SIGTERM (it
checkpoints and exits 75) and accounts the wall time with ``elastic_trainer.report.account``:
goodput = productive step time / wall time, where steps redone after a resume are not
productive. Prints the accounting as JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic_trainer.report import account  # noqa: E402
from tests import runs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs/demo-cpu.toml"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json-out")
    a = ap.parse_args()
    if not (REPO / "runs/data/demo.bin").exists():
        subprocess.run([*runs.CLI, "data", "build", "--out", str(REPO / "runs/data/demo.bin")], check=True, cwd=REPO, env=runs.env_for_tests())
    rng = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    run_dir = work / "run"
    kills = int(a.minutes * 60 // a.kill_every)
    args = ["--set", f"run.dir={run_dir}", "--set", f"checkpoint.dir={run_dir / 'ckpt'}", "--set", "train.steps=1000000",
            "--max-restarts", str(kills + 3)]
    for o in a.overrides:
        args += ["--set", o]
    proc = subprocess.Popen([*runs.CLI, "launch", a.config, *args], stdout=open(work / "launch.log", "ab"), stderr=subprocess.STDOUT,
                            cwd=REPO, env=runs.env_for_tests(), start_new_session=True)
    t0 = time.monotonic()
    end = t0 + a.minutes * 60
    killed = []
    try:
        next_kill = t0 + a.kill_every
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise SystemExit(f"the job exited early with {proc.returncode}; see {work / 'launch.log'}")
            if time.monotonic() >= next_kill:
                workers = runs.worker_pids(proc.pid)
                if workers:
                    victim = rng.choice(workers)
                    os.kill(victim, signal.SIGKILL)
                    killed.append(time.time())
                    print(f"t={time.monotonic() - t0:.0f}s: SIGKILL worker {victim}", flush=True)
                next_kill += a.kill_every
            time.sleep(0.2)
    finally:
        runs.stop_gracefully(proc)
    events = runs.read_events(run_dir)
    g = account(events)
    out = asdict(g)
    out.update(kills=len(killed), restarts=sum(1 for e in events if e["event"] == "restart"), minutes=a.minutes,
               steps=max((e["step"] for e in events if e["event"] == "step"), default=0), exit_code=proc.returncode, logs=str(work))
    print(json.dumps({k: v for k, v in out.items() if k != "interruptions"}, indent=1))
    print("\n| | seconds | share |\n|---|---|---|")
    for k in ("productive_seconds", "recompute_seconds", "interruption_seconds", "startup_seconds", "other_seconds"):
        print(f"| {k.removesuffix('_seconds')} | {out[k]:.1f} | {out[k] / g.wall_seconds:.3f} |")
    print(f"| **wall** | {g.wall_seconds:.1f} | goodput **{g.goodput:.3f}** |")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
