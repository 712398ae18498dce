"""Goodput under periodic SIGKILLs.

    python bench/goodput.py [--minutes 10] [--kill-every 120] [--config configs/demo-cpu.toml] [--set k=v ...]
    python bench/goodput.py --minutes 3 --kill-every 36,150 --interval auto,5,10,20,50   # a sweep
    python bench/goodput.py --table-from s0.json s1.json s2.json [--reaccount]   # repeats, mean per cell

Runs the config for ``--minutes`` under ``elastic-trainer launch``, SIGKILLs one worker (a
random rank, seeded) every ``--kill-every`` seconds, then stops the job with SIGTERM (it
checkpoints and exits 75) and accounts the wall time with ``elastic_trainer.report.account``:
goodput = productive step time / wall time, where steps redone after a resume are not
productive. Prints the accounting as JSON and a Markdown table, and what the steps themselves say
(:func:`step_times`: the median step, the time between steps, and the step-time excess the ledger
would charge a save that overlapped every step).

With several ``--kill-every`` rates, ``--interval`` values (``auto`` or a step count, set
as ``checkpoint.interval_steps``) and/or ``--tier`` values, runs every combination one after the
other (same seed, so the same ranks are killed; ``--tier memory:1`` runs a tier at one interval
only) and prints one table: goodput per run, its ratio
to the best fixed interval at the same kill rate and tier, and the intervals ``auto`` chose
(``checkpoint_interval_changed``). ``--tier remote`` saves every checkpoint to ``checkpoint.dir``
only; ``--tier memory`` adds the node-local tier in memory (``checkpoint.local_dir`` under
``/dev/shm``), so every save is an in-memory copy a restarted worker loads from, and
``checkpoint.dir`` gets every ``--remote-every``-th save.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, TINY_DEMO, parse_with_smoke
from elastic_trainer.goodput import MIN_REFERENCE_STEPS, REFERENCE_STEPS
from elastic_trainer.report import account
from tests import runs


def tier_overrides(tier: str, remote_every: int, shm: str) -> list[str]:
    """The settings of one ``--tier``: ``remote`` (checkpoint.dir only) or ``memory`` (the
    node-local tier in ``shm``, checkpoint.dir every ``remote_every``-th save)."""
    if tier == "remote":
        return []
    if tier == "memory":
        return [f"checkpoint.local_dir={shm}", f"checkpoint.remote_every={remote_every}"]
    raise SystemExit(f"--tier: unknown tier {tier!r} (remote or memory)")


def run_once(config: str, minutes: float, kill_every: float, seed: int, overrides: list[str]) -> dict:
    """One job under periodic SIGKILLs; the accounting of its event log."""
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    run_dir = work / "run"
    kills = int(minutes * 60 // kill_every)
    args = [
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        "--set",
        "train.steps=1000000",
        "--max-restarts",
        str(kills + 3),
    ]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.Popen(
        [*runs.CLI, "launch", config, *args],
        stdout=open(work / "launch.log", "ab"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=runs.env_for_tests(),
        start_new_session=True,
    )
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
    out.update(
        kills=len(killed),
        restarts=sum(1 for e in events if e["event"] == "restart"),
        minutes=minutes,
        kill_every=kill_every,
        steps=max((e["step"] for e in events if e["event"] == "step"), default=0),
        exit_code=proc.returncode,
        logs=str(work),
        commits=sum(1 for e in events if e["event"] == "checkpoint_committed"),
        chosen=[e["interval_steps"] for e in events if e["event"] == "checkpoint_interval_changed"],
        **step_times(events),
    )
    return out


def step_times(events: list[dict]) -> dict:
    """What the steps themselves say: the median step, the mean time between consecutive steps
    (the save call on the training thread, logging), and the mean excess of a step over the median
    of the recent steps, by the ledger's own rule (``elastic_trainer.goodput``), over *every* step:
    what the ledger would charge a save that overlaps every step, were its cost zero (in a run whose
    steps overlap no save, this machine's step-time noise)."""
    steps = [e for e in events if e["event"] == "step" and isinstance(e.get("step_time_s"), (int, float))]
    if not steps:
        return {}
    recent: collections.deque[float] = collections.deque(maxlen=REFERENCE_STEPS)
    excess, gaps, prev = [], [], None
    for e in steps:
        if prev is not None and e.get("world_size") != prev.get("world_size"):
            recent.clear()
        if len(recent) >= MIN_REFERENCE_STEPS:
            excess.append(max(0.0, e["step_time_s"] - statistics.median(recent)))
        recent.append(e["step_time_s"])
        if prev is not None and e["step"] == prev["step"] + 1:
            gaps.append(max(0.0, e["time"] - e["step_time_s"] - prev["time"]))
        prev = e
    return {
        "step_median_ms": round(statistics.median(e["step_time_s"] for e in steps) * 1e3, 2),
        "between_steps_ms": round(statistics.mean(gaps) * 1e3, 2) if gaps else None,
        "excess_over_recent_median_ms": round(statistics.mean(excess) * 1e3, 2) if excess else None,
    }


def print_one(out: dict) -> None:
    print(json.dumps({k: v for k, v in out.items() if k != "interruptions"}, indent=1))
    print("\n| | seconds | share |\n|---|---|---|")
    for k in ("productive_seconds", "recompute_seconds", "interruption_seconds", "startup_seconds", "other_seconds"):
        print(f"| {k.removesuffix('_seconds')} | {out[k]:.1f} | {out[k] / out['wall_seconds']:.3f} |")
    g = f"{out['goodput']:.3f}" if out["goodput"] is not None else "-"
    print(f"| **wall** | {out['wall_seconds']:.1f} | goodput **{g}** |")
    if out.get("step_median_ms") is not None:
        print(
            f"steps: median {out['step_median_ms']} ms, {out['between_steps_ms']} ms between steps, "
            f"{out['excess_over_recent_median_ms']} ms mean excess over the recent median (every step)"
        )


def print_sweep(results: list[dict]) -> None:
    print(
        "\n| kill every | tier | interval | kills | steps | commits | recomputed | goodput | / best fixed "
        "| auto chose |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rate, tier in sorted({(r["kill_every"], r.get("tier", "remote")) for r in results}):
        rows = [r for r in results if r["kill_every"] == rate and r.get("tier", "remote") == tier]
        fixed = [r["goodput"] for r in rows if r["interval"] != "auto" and r["goodput"] is not None]
        best = max(fixed) if fixed else None
        for r in rows:
            ratio = f"{r['goodput'] / best:.3f}" if best and r["goodput"] is not None else "-"
            g = f"{r['goodput']:.3f}" if r["goodput"] is not None else "-"
            chose = " → ".join(str(c) for c in r["chosen"]) if r["interval"] == "auto" else ""
            print(
                f"| {rate:.0f} s | {tier} | {r['interval']} | {r['kills']} | "
                f"{r['steps']} | {r['commits']} | {r['recompute_seconds']:.1f} s "
                f"({r['recompute_steps']} steps) | {g} | {ratio} | {chose} |"
            )


def reaccount(results: list[dict]) -> list[dict]:
    """Each run's goodput again from its event log (kept in ``logs``) with the current ledger."""
    out = []
    for r in results:
        events = runs.read_events(Path(r["logs"]) / "run")
        if not events:
            raise SystemExit(f"no event log left in {r['logs']} to re-account")
        g = asdict(account(events))
        out.append(
            {
                **r,
                **{k: g[k] for k in ("goodput", "recompute_seconds", "recompute_steps", "wall_seconds", "categories")},
            }
        )
    return out


def print_repeats(results: list[dict]) -> None:
    """Several runs per (rate, interval), e.g. from sweeps with different seeds: mean goodput per
    cell, its spread, and the ratio of the means to the best fixed interval's mean."""
    cells: dict[tuple[float, str], list[float]] = {}
    for r in results:
        cells.setdefault((r["kill_every"], str(r["interval"])), []).append(r["goodput"])
    print("\n| kill every | interval | runs | goodput, mean | min – max | / best fixed (means) |")
    print("|---|---|---|---|---|---|")
    for rate in sorted({k[0] for k in cells}):
        means = {iv: statistics.mean(g) for (rt, iv), g in cells.items() if rt == rate}
        fixed = [m for iv, m in means.items() if iv != "auto"]
        best = max(fixed) if fixed else None
        for iv in sorted(means, key=lambda x: (x != "auto", int(x) if x.isdigit() else 0)):
            g = cells[(rate, iv)]
            ratio = f"{means[iv] / best:.3f}" if best else "-"
            print(f"| {rate:.0f} s | {iv} | {len(g)} | {means[iv]:.3f} | {min(g):.3f} – {max(g):.3f} | {ratio} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs/demo-cpu.toml"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every", default="120", help="seconds between SIGKILLs; a comma-separated list sweeps")
    ap.add_argument(
        "--interval",
        default="",
        help="checkpoint.interval_steps: auto or N; a comma-separated list sweeps (default: the config's)",
    )
    ap.add_argument(
        "--tier",
        default="remote",
        help="remote, memory, or several comma-separated (side by side); tier:N runs that tier at interval N only",
    )
    ap.add_argument("--remote-every", type=int, default=10, help="with --tier memory: checkpoint.remote_every")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json-out")
    ap.add_argument(
        "--table-from", nargs="+", help="only print the table of --json-out files (several: also the mean per cell)"
    )
    ap.add_argument(
        "--reaccount",
        action="store_true",
        help="with --table-from: goodput from each run's event log with the current ledger",
    )
    a = parse_with_smoke(ap, ["--minutes", "0.1", "--kill-every", "3", *TINY_DEMO])
    if a.table_from:
        results = []
        for f in a.table_from:
            data = json.loads(Path(f).read_text())
            results += data if isinstance(data, list) else [data]
        if a.reaccount:
            results = reaccount(results)
        print_sweep(results)
        if len(a.table_from) > 1:
            print_repeats(results)
        return 0
    if not (REPO / "runs/data/demo.bin").exists():
        subprocess.run(
            [*runs.CLI, "data", "build", "--out", str(REPO / "runs/data/demo.bin")],
            check=True,
            cwd=REPO,
            env=runs.env_for_tests(),
        )
    rates = [float(x) for x in a.kill_every.split(",")]
    intervals = [x.strip() for x in a.interval.split(",") if x.strip()] or [""]
    tiers = [x.strip().partition(":") for x in a.tier.split(",") if x.strip()]  # tier[:interval]
    combos = [
        (rate, tier, interval) for rate in rates for tier, _, own in tiers for interval in ([own] if own else intervals)
    ]
    results = []
    for rate, tier, interval in combos:
        extra = [f"checkpoint.interval_steps={interval}"] if interval else []
        print(f"== kill every {rate:.0f} s, tier {tier}, interval {interval or 'from the config'}", flush=True)
        shm = tempfile.mkdtemp(prefix="bench-goodput-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            sets = [*a.overrides, *tier_overrides(tier, a.remote_every, shm), *extra]
            out = run_once(a.config, a.minutes, rate, a.seed, sets)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        out["interval"] = interval or "config"
        out["tier"] = tier
        results.append(out)
        print_one(out)
        if a.json_out:  # after every run: a cut-short sweep keeps what ran
            Path(a.json_out).write_text(json.dumps(results if len(combos) > 1 else out, indent=2, default=str))
    if len(results) > 1:
        print_sweep(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
