"""Recovery time after SIGKILL of one worker ÷ the same run's cold start, warm and cold starts side by side.

    python bench/recovery.py [--config configs/demo-cpu.toml] [--kills 3] [--modes cold,warm]
                             [--kill-gap 65] [--set k=v ...]

For each mode (``elastic.warm_start = false|true``) runs the config under ``elastic-trainer
launch`` (run and checkpoint dirs in a scratch dir), measures the cold start (the launch
command started → its first completed step), then ``--kills`` times waits for a committed
checkpoint, SIGKILLs the highest-ranked worker mid-training, and measures from the kill to the
first step completed after the resume:

* detect      kill → the agent's ``restart`` event (monitor interval)
* stop        ``restart`` → rendezvous starts (stopping the surviving workers, back-off)
* rendezvous  the agent's rendezvous round (``rendezvous.seconds``)
* spawn       rendezvous done → ``workers_started`` (the agent starts the processes: fork from the
              zygote, or ``Popen``)
* init        ``workers_started`` → worker ``start`` (cold: interpreter + imports; both: process
              groups, model)
* load        checkpoint decision + DCP load (``start`` → ``resume``; ``load_seconds`` is DCP)
* first step  ``resume`` → the first ``step`` event

Kills are at least ``--kill-gap`` seconds after the previous restart, so each is an isolated
failure (the supervisor backs off only for failures within 60 s of each other, a crash loop).
Prints one JSON line per kill and a Markdown table of medians per mode, with recovery ÷ cold start.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, TINY_DEMO, parse_with_smoke
from tests import runs

PHASES = ("detect", "stop", "rendezvous", "spawn", "init", "load", "first_step")


def ensure_data(path: Path) -> None:
    if not path.exists():
        subprocess.run([*runs.CLI, "data", "build", "--out", str(path)], check=True, cwd=REPO, env=runs.env_for_tests())


def breakdown(events: list[dict], killed_at: float) -> dict:
    after = [e for e in events if e["time"] >= killed_at]

    def first(name: str) -> dict:
        return next(e for e in after if e["event"] == name)

    restart, rdzv, start, resume = first("restart"), first("rendezvous"), first("start"), first("resume")
    started = first("workers_started")
    step = next(e for e in after if e["event"] == "step" and e["time"] > resume["time"])
    last_before = max(e["step"] for e in events if e["event"] == "step" and e["time"] < killed_at)
    rdzv_begin = rdzv["time"] - rdzv["seconds"]
    return {
        "total": step["time"] - killed_at,
        "detect": restart["time"] - killed_at,
        "stop": rdzv_begin - restart["time"],
        "rendezvous": rdzv["seconds"],
        "spawn": started["time"] - rdzv["time"],
        "init": start["time"] - started["time"],
        "load": resume["time"] - start["time"],
        "dcp_load": resume["load_seconds"],
        "first_step": step["time"] - resume["time"],
        "resumed_from": resume["step"],
        "lost_steps": last_before - resume["step"],
        "backoff": restart["backoff_seconds"],
        "warm": started["warm"],
    }


def run_mode(a, warm: bool) -> dict:
    """One launch with ``elastic.warm_start = warm``: its cold start and ``a.kills`` recoveries."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-recovery-{'warm' if warm else 'cold'}-"))
    run_dir = work / "run"
    args = [
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        "--set",
        "train.steps=100000",
        "--set",
        f"elastic.warm_start={'true' if warm else 'false'}",
        "--max-restarts",
        str(a.kills + 2),
    ]
    for o in a.overrides:
        args += ["--set", o]
    log = open(work / "launch.log", "ab")
    launched_at = time.time()
    proc = subprocess.Popen(
        [*runs.CLI, "launch", a.config, *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=runs.env_for_tests(),
        start_new_session=True,
    )
    results = []
    try:
        first_step = runs.wait_event(run_dir, "step", 600, proc)
        cold_start = first_step["time"] - launched_at
        print(json.dumps({"mode": "warm" if warm else "cold", "cold_start": round(cold_start, 3)}), flush=True)
        last_restart = 0.0  # the first kill needs no gap
        for i in range(a.kills):
            since = max(time.time(), last_restart + a.kill_gap - 15)
            while time.time() < since:
                time.sleep(0.5)
            c = runs.wait_event(
                run_dir, "checkpoint_committed", 600, proc, where=lambda r, since=since: r["time"] > since
            )
            # Kill a few steps after a commit (the typical case is mid-interval; lost work is reported apart).
            min_step, not_before = c["step"] + 3, last_restart + a.kill_gap
            runs.wait_event(
                run_dir,
                "step",
                300,
                proc,
                where=lambda r, min_step=min_step, not_before=not_before: (
                    r["step"] >= min_step and r["time"] >= not_before
                ),
            )
            victim = runs.worker_pids(proc.pid)[-1]
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            runs.wait_event(run_dir, "resume", 300, proc, where=lambda r, killed_at=killed_at: r["time"] > killed_at)

            def stepped_after_resume(r, killed_at=killed_at):
                return (
                    r["time"] > killed_at
                    and r["step"] > 0
                    and any(
                        e["event"] == "resume" and killed_at < e["time"] < r["time"]
                        for e in runs.read_events(run_dir, "resume")
                    )
                )

            runs.wait_event(run_dir, "step", 300, proc, where=stepped_after_resume)
            last_restart = time.time()
            res = breakdown(runs.read_events(run_dir), killed_at)
            res["ratio"] = res["total"] / cold_start
            results.append(res)
            print(
                json.dumps(
                    {
                        "mode": "warm" if warm else "cold",
                        "kill": i + 1,
                        **{k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()},
                    }
                ),
                flush=True,
            )
    finally:
        runs.stop_gracefully(proc)
    steady = [e["step_time_s"] for e in runs.read_events(run_dir, "step")[5:]]
    med = {k: statistics.median(r[k] for r in results) for k in ("total", *PHASES, "dcp_load", "backoff")}
    return {
        "cold_start": cold_start,
        "kills": results,
        "median": med,
        "ratio": med["total"] / cold_start,
        "step_time_s": statistics.median(steady),
        "logs": str(work),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs/demo-cpu.toml"))
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--modes", default="cold,warm", help="comma-separated: cold (elastic.warm_start=false), warm")
    ap.add_argument("--kill-gap", type=float, default=65.0, help="seconds between a restart and the next kill")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json-out", help="write the results here")
    a = parse_with_smoke(ap, ["--kills", "1", "--modes", "warm", "--kill-gap", "0", *TINY_DEMO])
    ensure_data(REPO / "runs/data/demo.bin")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"cold", "warm"}:
        ap.error("--modes: give cold, warm or both")
    out = {m: run_mode(a, m == "warm") for m in modes}
    print("\n| phase (median seconds) | " + " | ".join(modes) + " |\n|---|" + "---|" * len(modes))
    for k in (*PHASES, "total"):
        print(f"| {k} | " + " | ".join(f"{out[m]['median'][k]:.2f}" for m in modes) + " |")
    print("| cold start (launch → first step) | " + " | ".join(f"{out[m]['cold_start']:.2f}" for m in modes) + " |")
    print("| **recovery ÷ cold start** | " + " | ".join(f"**{out[m]['ratio']:.2f}**" for m in modes) + " |")
    for m in modes:
        print(f"\n{m}: steady step time {out[m]['step_time_s']:.3f}s; {a.kills} kills; logs in {out[m]['logs']}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
