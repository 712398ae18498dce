"""What a replay audit costs, against the training it audits.

    python bench/audit_cost.py [--steps 60] [--interval 20] [--from 20] [--repeats 3] [--set k=v ...]

Each round trains ``configs/demo-cpu.toml`` for ``--steps`` steps under ``elastic-trainer launch``
(a commit every ``--interval`` steps, all kept), then runs ``elastic-trainer ckpt audit`` over
``--from`` → the last step, and times both in the same round: the audited interval's training
time (the ``step`` events' clock from step A to step B: the steps and the saves that overlapped
them) and the audit's wall time (a replay launch from commit A, its saves, the comparison and the
verdicts). Prints per round and the median: audit ÷ interval (what an audit costs per second of
training it certifies; the launch's start-up is its fixed part, so the ratio falls towards 1
as the interval grows) and audit ÷ the whole training launch.

``--flip-at S`` adds, to each round, the same launch with ``train.on_nonfinite = "replay"`` and a
large bit flip on rank 1 after step S (its next step's gradient overflows): the run rolls back to
its newest commit, replays, names the rank and finishes. Its wall time against the clean launch's
is what one automatic replay costs, and so, on the run's own clock, the time from the refused step
to the replay's verdict against the clean run's time for the same steps; the losses must equal
the clean launch's, bitwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, TINY_DEMO, machine_info, median, parse_with_smoke, table
from tests import runs

DATA = REPO / "runs/data/demo.bin"


def _run(args: list[str], log: Path) -> float:
    """Run one CLI command to completion (exit 0 demanded); its wall seconds."""
    t0 = time.monotonic()
    with open(log, "wb") as out:
        r = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=runs.env_for_tests(), timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args[2:5])}... exited {r.returncode}:\n{log.read_text()[-3000:]}")
    return time.monotonic() - t0


def _sets(a, run_dir: Path) -> list[str]:
    return [
        *("--set", f"run.dir={run_dir}", "--set", f"checkpoint.dir={run_dir / 'ckpt'}", "--set", f"data.path={DATA}"),
        *("--set", f"train.steps={a.steps}", "--set", f"checkpoint.interval_steps={a.interval}"),
        *("--set", f"checkpoint.keep_last={a.steps // a.interval + 1}", "--set", "metrics.port=0"),
        *(x for kv in a.overrides for x in ("--set", kv)),
    ]


def _replay_round(a, work: Path, clean_launch: float) -> dict:
    """``--flip-at``: the launch with an anomaly replayed, against the clean one of the round."""
    run_dir = work / "replay"
    flip = f"bitflip@rank=1,step={a.flip_at},bit=30,param=qkv"
    sets = [*_sets(a, run_dir), "--set", 'train.on_nonfinite="replay"']
    t0 = time.monotonic()
    with open(work / "replay.log", "wb") as out:
        env = runs.env_for_tests({"ELASTIC_TRAINER_INJECT_FAULT": flip})
        r = subprocess.run(
            [*runs.CLI, "launch", str(REPO / a.config), *sets], stdout=out, stderr=out, env=env, cwd=REPO
        )
    seconds = time.monotonic() - t0
    (replay,) = runs.read_events(run_dir, "anomaly_replay") or [None]
    found = runs.read_events(run_dir, "silent_corruption")
    same = runs.step_losses(run_dir) == runs.step_losses(work / "run")
    if r.returncode != 0 or replay is None or not found or not same:
        log = (work / "replay.log").read_text()[-3000:]
        raise SystemExit(f"the replayed launch did not finish on the clean curve:\n{log}")
    refused = (runs.read_events(run_dir, "nonfinite") + runs.read_events(run_dir, "loss_spike"))[0]
    clean = {r["step"]: r["time"] for r in runs.read_events(work / "run", "step")}
    replay_s = found[0]["time"] - refused["time"]  # the reload and the steps replayed, on the run's own clock
    return {
        "replay_launch_s": seconds,
        "replay_per_launch": seconds / clean_launch,
        "replayed_steps": replay["step"] - replay["from_step"],
        "replay_s": replay_s,
        "replay_per_clean_steps": replay_s / (clean[replay["step"]] - clean[replay["from_step"]]),
    }


def one_round(a, work: Path) -> dict:
    run_dir, ckpt = work / "run", work / "run" / "ckpt"
    launch = _run([*runs.CLI, "launch", str(REPO / a.config), *_sets(a, run_dir)], work / "train.log")
    steps = {r["step"]: r["time"] for r in runs.read_events(run_dir, "step")}
    interval = steps[a.steps] - steps[a.first]
    audit_args = ["--from", str(a.first), "--to", str(a.steps), "--scratch", str(work)]
    audit = _run([*runs.CLI, "ckpt", "audit", str(ckpt), *audit_args], work / "audit.log")
    lines = (work / "audit.log").read_text().split("\n")
    certified = sum(1 for line in lines if line.startswith("step ") and line.endswith(" certified"))
    out = {
        "launch_s": launch,
        "interval_s": interval,
        "audit_s": audit,
        "certified": certified,
        "audit_per_interval": audit / interval,
        "audit_per_launch": audit / launch,
    }
    return {**out, **_replay_round(a, work, launch)} if a.flip_at else out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo-cpu.toml")
    ap.add_argument("--steps", type=int, default=60, help="steps trained (the audit ends at the last)")
    ap.add_argument("--interval", type=int, default=20, help="checkpoint.interval_steps")
    ap.add_argument("--from", dest="first", type=int, default=20, help="the commit the audit replays from")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="more config overrides")
    ap.add_argument("--json-out", help="write the rounds here")
    ap.add_argument("--flip-at", type=int, default=0, help="also a launch with this step's flip replayed (0: none)")
    tiny = ["--steps", "4", "--interval", "2", "--from", "2", "--repeats", "1"]
    a = parse_with_smoke(ap, [*tiny, *TINY_DEMO], argv)
    if a.first % a.interval or a.steps % a.interval or not 0 < a.first < a.steps:
        ap.error("--from and --steps must be commits (multiples of --interval), --from below --steps")
    if not DATA.exists():
        subprocess.run([*runs.CLI, "data", "build", "--out", str(DATA)], check=True, cwd=REPO, env=runs.env_for_tests())
    rounds = []
    for i in range(a.repeats):
        with tempfile.TemporaryDirectory(prefix="bench-audit-") as work:
            rounds.append(one_round(a, Path(work)))
        print(f"round {i + 1}: {json.dumps({k: round(v, 3) for k, v in rounds[-1].items()})}", flush=True)
    want = (a.steps - a.first) // a.interval
    if any(r["certified"] != want for r in rounds):
        raise SystemExit(f"an audit did not certify all {want} commits: {rounds}")
    keys = ("launch_s", "interval_s", "audit_s", "audit_per_interval", "audit_per_launch")
    rows = [[i + 1, *(f"{r[k]:.2f}" for k in keys)] for i, r in enumerate(rounds)]
    rows.append(["median", *(f"**{median([r[k] for r in rounds]):.2f}**" for k in keys)])
    print(f"\n{a.config}, {a.steps} steps, commits every {a.interval}, audit {a.first} → {a.steps}")
    print(table(["round", "training launch s", "interval s", "audit s", "audit ÷ interval", "audit ÷ launch"], rows))
    if a.flip_at:
        keys = (
            "launch_s",
            "replay_launch_s",
            "replay_per_launch",
            "replayed_steps",
            "replay_s",
            "replay_per_clean_steps",
        )
        rows = [[i + 1, *(f"{r[k]:.2f}" for k in keys)] for i, r in enumerate(rounds)]
        rows.append(["median", *(f"**{median([r[k] for r in rounds]):.2f}**" for k in keys)])
        print(f"\ntrain.on_nonfinite = replay, a large flip on rank 1 after step {a.flip_at}")
        head = ["round", "clean launch s", "replayed launch s", "replayed ÷ clean", "steps replayed", "replay s"]
        print(table([*head, "replay ÷ the clean run's same steps"], rows))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"machine": machine_info(), "args": vars(a), "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
