"""Recovery after SIGKILL of one worker: ``launch``, ``run`` (warm, cold) and plain ``torchrun``, side by side,
at several points of the save cycle.

    python bench/run_recovery.py [--repeats 3] [--nproc 2] [--variants launch,run,run-cold,torchrun]
                                 [--kill-points after-commit,mid-cycle,mid-save,before-next] [--kill-rank 0]
                                 [--interval 10] [--set KEY=VALUE ...] [--script examples/train_fsdp.py]
                                 [--phases] [--json-out F] [--smoke]

One invocation runs every variant at every kill point, order reversed every repeat:

* ``launch``    ``elastic-trainer launch`` of the built-in trainer (``configs/demo-cpu.toml``)
* ``run``       ``elastic-trainer run ... SCRIPT`` (warm restarts: workers forked from the zygote)
* ``run-cold``  ``elastic-trainer run --no-warm-start ... SCRIPT`` (workers started as torchrun does)
* ``torchrun``  ``torchrun ... SCRIPT`` (no supervisor)

The script (``examples/train_fsdp.py`` by default: the loop API over a ``DataLoader`` with a worker
process) runs with ``--steps 100000`` so it never ends by itself; every variant gets
``--standalone --nproc-per-node N --max-restarts 1 --monitor-interval 0.1`` and
``checkpoint.interval_steps = I`` (``--interval``, default 10). ``--set`` passes more settings
(``--set model.dim=416`` for a ~10 × larger demo state, ``launch`` only).

Kill points (``--kill-points``), rank ``--kill-rank``'s worker SIGKILLed by the fault injection
(``ELASTIC_TRAINER_INJECT_FAULT``) at the start of a step, resuming from the commit named:

* ``after-commit``  step 2I+1, once step 2I is committed (resumes from 2I)
* ``mid-cycle``     step 1.5 I, once step I is committed (the demo's step 15 for I = 10; resumes from I)
* ``mid-save``      right after the async save of step 2I starts (resumes from I)
* ``before-next``   step 3I-1, once step 2I is committed (resumes from 2I)
* ``signal``        from outside, the newest worker, once a step past the first commit >= I is done

Recovery = the last ``step`` event before the failure (for ``signal``: the kill) → the first
``step`` event after the ``resume`` that follows it. ``decision + load`` = the ``start`` event →
the ``resume`` event (the catalog's decision, the state's initialisation, DCP's load);
``load MB/s`` = the commit's bytes ÷ DCP's load (``load_seconds``). Then the job is stopped.

``--phases`` prints the timeline of each recovery (seconds after the kill): ``survivors_exit``
(``signal`` only: the last surviving worker process gone, polled every 5 ms), ``restart`` (the
supervisor's event: it noticed and stops the group), ``rendezvous`` (the group stopped and the
next round formed), ``workers_started`` (processes forked or started), ``start`` (rank 0
initialised: process groups), ``resume`` (checkpoint loaded), ``step`` (the first step after it);
then the ``resume`` event's own phases (rank 0's seconds: see
``elastic_trainer/checkpoint/timeline.py``). Plain torchrun has no supervisor events.

``--smoke``: one repeat of ``run`` and ``torchrun``, a commit at step 2, a few seconds — it proves the
script still runs (CI), not a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, loadavg, machine_info, median, parse_with_smoke, table
from elastic_trainer.checkpoint.timeline import PHASES as PHASES_OF_RESUME
from tests import runs

VARIANTS = ("launch", "run", "run-cold", "torchrun")
KILL_POINTS = ("after-commit", "mid-cycle", "mid-save", "before-next", "signal")
PHASES = ("survivors_exit", "restart", "rendezvous", "workers_started", "start", "resume", "step")
DEMO = REPO / "configs" / "demo-cpu.toml"
DEMO_DATA = REPO / "runs" / "data" / "demo.bin"


def command(variant: str, a, run_dir: Path, ckpt: Path) -> list[str]:
    opts = ["--standalone", "--nproc-per-node", str(a.nproc), "--max-restarts", "1", "--monitor-interval", "0.1"]
    paths = ["--set", f"run.dir={run_dir}", "--set", f"checkpoint.dir={ckpt}"]
    interval = ["--set", f"checkpoint.interval_steps={a.interval}"]
    if variant == "launch":
        more = [x for kv in a.set for x in ("--set", kv)]
        return [*runs.CLI, "launch", str(DEMO), *paths, *interval, "--set", "train.steps=100000", "--set",
                "metrics.port=0", "--set", f"data.path={DEMO_DATA}", *more, *opts]  # fmt: skip
    script_args = [a.script, "--steps", "100000"]
    if variant == "torchrun":  # the script's own --set: the same paths, no supervisor
        return [sys.executable, "-m", "torch.distributed.run", *opts, *script_args, *paths, *interval]
    cold = ["--no-warm-start"] if variant == "run-cold" else []
    # the interval also as the script's own --set: its built-in settings win over the supervisor's
    return [*runs.CLI, "run", *cold, *paths, *interval, "--set", "metrics.port=0", *opts, *script_args, *interval]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for c in runs.children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def workers(launcher: int, variant: str, script: str) -> list[int]:
    """The training processes under ``launcher`` (Popen children, or the zygote's forks); not the
    DataLoader's worker processes (their own process groups)."""
    if variant == "launch":
        return runs.worker_pids(launcher)
    return training_processes(launcher, os.path.basename(script).encode())


def training_processes(launcher: int, marker: bytes) -> list[int]:
    """The processes under ``launcher`` that train: a warm start's forks (``et-worker*``) or the
    processes whose command line holds ``marker``, not torchrun's agent nor our supervisor, and
    not their DataLoader workers (a match whose parent matched too)."""
    found = {}
    for p in descendants(launcher):
        try:
            comm = open(f"/proc/{p}/comm").read().strip()
            cmd = open(f"/proc/{p}/cmdline", "rb").read()
            ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if comm.startswith("et-worker") or (
            marker in cmd and b"torch.distributed.run" not in cmd and b"elastic_trainer.cli" not in cmd
        ):
            found[p] = ppid
    return sorted(p for p, ppid in found.items() if ppid not in found)


def wait_gone(pids: list[int], timeout: float) -> float | None:
    """time.time() when the last of ``pids`` exited (a zombie counts), polled every 5 ms."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(runs.alive(p) for p in pids):
            return time.time()
        time.sleep(0.005)
    return None


def fault(point: str, rank: int, interval: int) -> str | None:
    """The ``ELASTIC_TRAINER_INJECT_FAULT`` entry that kills at ``point`` (None: ``signal``)."""
    i = interval
    return {
        "after-commit": f"kill@rank={rank},step={2 * i + 1},committed={2 * i}",
        "mid-cycle": f"kill@rank={rank},step={i + i // 2},committed={i}",
        "mid-save": f"kill_in_save@rank={rank},step={2 * i}",
        "before-next": f"kill@rank={rank},step={3 * i - 1},committed={2 * i}",
        "signal": None,
    }[point]


def timeline(events: list[dict], killed_at: float, survivors_exit: float | None) -> dict:
    after = [e for e in events if e["time"] > killed_at]
    out = {"survivors_exit": None if survivors_exit is None else survivors_exit - killed_at}
    for name in PHASES[1:-1]:
        e = next((e for e in after if e["event"] == name), None)
        out[name] = None if e is None else e["time"] - killed_at
    resume = next(e for e in after if e["event"] == "resume")
    step = next(e for e in after if e["event"] == "step" and e["time"] > resume["time"])
    out["step"] = step["time"] - killed_at
    out["dcp_load"] = resume.get("load_seconds")
    return out


def kill_time(events: list[dict]) -> float:
    """The last ``step`` event before the first sign of the failure: a ``failure`` (a survivor's),
    the supervisor's ``restart``, or the restarted group's ``start``."""
    failed = min(
        e["time"]
        for e in events
        if e["event"] in ("failure", "restart") or (e["event"] == "start" and e.get("restart_count", 0) >= 1)
    )
    return max(e["time"] for e in events if e["event"] == "step" and e["time"] < failed)


def one_run(variant: str, point: str, a) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"bench-runrec-{variant}-"))
    run_dir, ckpt = work / "run", work / "ckpt"
    run_dir.mkdir()
    inject = fault(point, a.kill_rank, a.interval)
    proc = subprocess.Popen(
        command(variant, a, run_dir, ckpt),
        stdout=open(work / "log", "ab"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=runs.env_for_tests({"ELASTIC_TRAINER_INJECT_FAULT": inject}),
        start_new_session=True,
    )
    try:
        survivors_exit = None
        if inject is None:
            runs.wait_event(run_dir, "checkpoint_committed", 300, proc, where=lambda r: r["step"] >= a.interval)
            committed = max(e["step"] for e in runs.read_events(run_dir, "checkpoint_committed"))
            runs.wait_event(run_dir, "step", 120, proc, where=lambda r: r["step"] > committed)
            pids = workers(proc.pid, variant, a.script)
            if len(pids) != a.nproc:
                raise RuntimeError(f"{variant}: found workers {pids} (log {work / 'log'})")
            killed_at = time.time()
            os.kill(pids[-1], signal.SIGKILL)
            survivors_exit = wait_gone(pids[:-1], 60)
        else:
            runs.wait_event(run_dir, "start", 300, proc, where=lambda r: r.get("restart_count", 0) >= 1)
            killed_at = kill_time(runs.read_events(run_dir))
        resume = runs.wait_event(run_dir, "resume", 300, proc, where=lambda r: r["time"] > killed_at)
        runs.wait_event(run_dir, "step", 120, proc, where=lambda r: r["time"] > resume["time"])
        events = runs.read_events(run_dir)
        steps = [e["step_time_s"] for e in events if e["event"] == "step" and e["time"] <= killed_at]
        phases = timeline(events, killed_at, survivors_exit)
        started = [e for e in events if e["event"] == "workers_started" and e["time"] > killed_at]
        start = next(e for e in events if e["event"] == "start" and e["time"] > killed_at)
        loaded = [e for e in events if e["event"] == "checkpoint_committed" and e["step"] == resume["step"]]
        load_s = resume.get("load_seconds")
        out = {
            "variant": variant,
            "kill_point": point,
            "recovery_s": phases["step"],
            "decision_load_s": resume["time"] - start["time"],
            "median_step_s": median(steps[-20:]) if steps else None,
            "resumed_step": resume["step"],
            "warm": started[0]["warm"] if started else None,
            "load_mb_s": loaded[0]["bytes"] / 1e6 / load_s if loaded and load_s else None,
            "phases": phases,
            "resume_phases": resume.get("phases", {}),
        }
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                runs.stop(proc)
        for p in descendants(proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(work, ignore_errors=True)
    return out


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _med(rs: list[dict], get) -> float | None:
    xs = [x for x in map(get, rs) if x is not None]
    return median(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", default=str(REPO / "examples" / "train_fsdp.py"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--kill-points", default=",".join(KILL_POINTS[:-1]), help=f"of {', '.join(KILL_POINTS)}")
    ap.add_argument("--kill-rank", type=int, default=0, help="the rank killed at an injected kill point")
    ap.add_argument("--interval", type=int, default=10, help="checkpoint.interval_steps")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for launch")
    ap.add_argument("--phases", action="store_true", help="print each recovery's timeline")
    ap.add_argument("--json-out")
    tiny = ["--repeats", "1", "--variants", "run,torchrun", "--interval", "2", "--kill-points", "after-commit"]
    a = parse_with_smoke(ap, [*tiny, "--phases"], argv)
    variants, points = a.variants.split(","), a.kill_points.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "torchrun" not in variants:
        raise SystemExit(
            f"--variants: choose from {', '.join(VARIANTS)}, torchrun included (the reference); got {a.variants!r}"
        )
    if any(p not in KILL_POINTS for p in points):
        raise SystemExit(f"--kill-points: choose from {', '.join(KILL_POINTS)}; got {a.kill_points!r}")
    if "launch" in variants and not DEMO_DATA.exists():
        subprocess.run([*runs.CLI, "data", "build", "--out", str(DEMO_DATA)], check=True, cwd=REPO)
    info = machine_info()
    info["loadavg_start"] = loadavg()
    info["command"] = " ".join(["python", *(sys.argv if argv is None else ["bench/run_recovery.py", *argv])])
    results = []
    for rep in range(a.repeats):
        order = [(v, p) for p in points for v in variants]
        for v, p in order if rep % 2 == 0 else list(reversed(order)):
            r = one_run(v, p, a)
            r["repeat"] = rep
            results.append(r)
            print(json.dumps(r), flush=True)
    info["loadavg_end"] = loadavg()
    rows, prow, rrow = [], [], []
    for p in points:
        ref = _med(
            [r for r in results if r["variant"] == "torchrun" and r["kill_point"] == p], lambda r: r["recovery_s"]
        )
        for v in variants:
            rs = [r for r in results if r["variant"] == v and r["kill_point"] == p]
            rec = [r["recovery_s"] for r in rs]
            step = _med(rs, lambda r: r["median_step_s"])
            mbs = _med(rs, lambda r: r["load_mb_s"])
            rows.append(
                [
                    v,
                    p,
                    f"**{median(rec):.2f}**",
                    ", ".join(f"{x:.2f}" for x in rec),
                    f"**{_med(rs, lambda r: r['decision_load_s']):.2f}**",
                    f"{step:.3f}",
                    f"{median(rec) / step:.1f}",
                    f"{median(rec) / ref:.2f}",
                    "–" if mbs is None else f"{mbs:.0f}",
                ]  # fmt: skip
            )
            prow.append([v, p, *(_fmt(_med(rs, lambda r, k=k: r["phases"][k])) for k in PHASES)])
            rrow.append([v, p, *(_fmt(_med(rs, lambda r, k=k: r["resume_phases"].get(k))) for k in PHASES_OF_RESUME)])
    print(
        f"\nmachine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}; "
        f"load {info['loadavg_start'][0]:.2f} → {info['loadavg_end'][0]:.2f}"
    )
    print(f"command: {info['command']}\n")
    head = ["variant", "kill point", "recovery s (median)", "per run", "decision + load s", "median step s"]
    print(table([*head, "in steps", "÷ torchrun", "load MB/s"], rows))
    if a.phases:
        print("\nper-phase timeline (seconds after the kill, median over repeats):\n")
        print(table(["variant", "kill point", *PHASES], prow))
        print("\nthe resume event's phases (rank 0, seconds, median over repeats):\n")
        print(table(["variant", "kill point", *PHASES_OF_RESUME], rrow))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"info": info, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
