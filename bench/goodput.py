"""Goodput under periodic SIGKILLs.

    python bench/goodput.py [--minutes 10] [--kill-every 120] [--config configs/demo-cpu.toml] [--set k=v ...]
    python bench/goodput.py --minutes 3 --kill-every 36,150 --interval auto,5,10,20,50   # a sweep

Runs the config for ``--minutes`` under ``elastic-trainer launch``, SIGKILLs one worker (a
random rank, seeded) every ``--kill-every`` seconds, then stops the job with SIGTERM (it
checkpoints and exits 75) and accounts the wall time with ``elastic_trainer.report.account``:
goodput = productive step time / wall time, where steps redone after a resume are not
productive. Prints the accounting as JSON and a Markdown table.

With several ``--kill-every`` rates and/or ``--interval`` values (``auto`` or a step count, set
as ``checkpoint.interval_steps``), runs every combination one after the other (same seed, so
the same ranks are killed) and prints one table: goodput per run, its ratio to the best fixed
interval at the same kill rate, and the intervals ``auto`` chose (``checkpoint_interval_changed``).
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


def run_once(config: str, minutes: float, kill_every: float, seed: int, overrides: list[str]) -> dict:
    """One job under periodic SIGKILLs; the accounting of its event log."""
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    run_dir = work / "run"
    kills = int(minutes * 60 // kill_every)
    args = ["--set", f"run.dir={run_dir}", "--set", f"checkpoint.dir={run_dir / 'ckpt'}", "--set", "train.steps=1000000",
            "--max-restarts", str(kills + 3)]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.Popen([*runs.CLI, "launch", config, *args], stdout=open(work / "launch.log", "ab"), stderr=subprocess.STDOUT,
                            cwd=REPO, env=runs.env_for_tests(), start_new_session=True)
    t0 = time.monotonic()
    end = t0 + minutes * 60
    killed = []
    try:
        next_kill = t0 + kill_every
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
                next_kill += kill_every
            time.sleep(0.2)
    finally:
        runs.stop_gracefully(proc)
    events = runs.read_events(run_dir)
    g = account(events)
    out = asdict(g)
    out.update(kills=len(killed), restarts=sum(1 for e in events if e["event"] == "restart"), minutes=minutes, kill_every=kill_every,
               steps=max((e["step"] for e in events if e["event"] == "step"), default=0), exit_code=proc.returncode, logs=str(work),
               commits=sum(1 for e in events if e["event"] == "checkpoint_committed"),
               chosen=[e["interval_steps"] for e in events if e["event"] == "checkpoint_interval_changed"])
    return out


def print_one(out: dict) -> None:
    print(json.dumps({k: v for k, v in out.items() if k != "interruptions"}, indent=1))
    print("\n| | seconds | share |\n|---|---|---|")
    for k in ("productive_seconds", "recompute_seconds", "interruption_seconds", "startup_seconds", "other_seconds"):
        print(f"| {k.removesuffix('_seconds')} | {out[k]:.1f} | {out[k] / out['wall_seconds']:.3f} |")
    g = f"{out['goodput']:.3f}" if out["goodput"] is not None else "-"
    print(f"| **wall** | {out['wall_seconds']:.1f} | goodput **{g}** |")


def print_sweep(results: list[dict]) -> None:
    print("\n| kill every | interval | kills | steps | commits | recomputed | goodput | / best fixed | auto chose |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rate in sorted({r["kill_every"] for r in results}):
        rows = [r for r in results if r["kill_every"] == rate]
        fixed = [r["goodput"] for r in rows if r["interval"] != "auto" and r["goodput"] is not None]
        best = max(fixed) if fixed else None
        for r in rows:
            ratio = f"{r['goodput'] / best:.3f}" if best and r["goodput"] is not None else "-"
            g = f"{r['goodput']:.3f}" if r["goodput"] is not None else "-"
            chose = " → ".join(str(c) for c in r["chosen"]) if r["interval"] == "auto" else ""
            print(f"| {rate:.0f} s | {r['interval']} | {r['kills']} | {r['steps']} | {r['commits']} | {r['recompute_seconds']:.1f} s "
                  f"({r['recompute_steps']} steps) | {g} | {ratio} | {chose} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs/demo-cpu.toml"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every", default="120", help="seconds between SIGKILLs; a comma-separated list sweeps")
    ap.add_argument("--interval", default="", help="checkpoint.interval_steps: auto or N; a comma-separated list sweeps (default: the config's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json-out")
    ap.add_argument("--table-from", help="only print the sweep table of a --json-out file")
    a = ap.parse_args()
    if a.table_from:
        print_sweep(json.loads(Path(a.table_from).read_text()))
        return 0
    if not (REPO / "runs/data/demo.bin").exists():
        subprocess.run([*runs.CLI, "data", "build", "--out", str(REPO / "runs/data/demo.bin")], check=True, cwd=REPO, env=runs.env_for_tests())
    rates = [float(x) for x in a.kill_every.split(",")]
    intervals = [x.strip() for x in a.interval.split(",") if x.strip()] or [""]
    results = []
    for rate in rates:
        for interval in intervals:
            extra = [f"checkpoint.interval_steps={interval}"] if interval else []
            print(f"== kill every {rate:.0f} s, interval {interval or 'from the config'}", flush=True)
            out = run_once(a.config, a.minutes, rate, a.seed, [*a.overrides, *extra])
            out["interval"] = interval or "config"
            results.append(out)
            print_one(out)
            if a.json_out:  # after every run: a cut-short sweep keeps what ran
                Path(a.json_out).write_text(json.dumps(results if len(rates) * len(intervals) > 1 else out, indent=2, default=str))
    if len(results) > 1:
        print_sweep(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
