"""Recovery after SIGKILL of one worker: ``launch``, ``run`` (warm, cold) and plain ``torchrun``, side by side.

    python bench/run_recovery.py [--repeats 3] [--nproc 2] [--variants launch,run,run-cold,torchrun]
                                 [--script examples/train_fsdp.py] [--phases] [--json-out F] [--smoke]

One invocation runs every variant, order reversed every repeat:

* ``launch``    ``elastic-trainer launch`` of the built-in trainer (``configs/demo-cpu.toml``)
* ``run``       ``elastic-trainer run ... SCRIPT`` (warm restarts: workers forked from the zygote)
* ``run-cold``  ``elastic-trainer run --no-warm-start ... SCRIPT`` (workers started as torchrun does)
* ``torchrun``  ``torchrun ... SCRIPT`` (no supervisor)

The script (``examples/train_fsdp.py`` by default: the loop API over a ``DataLoader`` with a worker
process) runs with ``--steps 100000`` so it never ends by itself; every variant gets
``--standalone --nproc-per-node N --max-restarts 1 --monitor-interval 0.1``. Once a checkpoint is
committed (step >= 5) and a step past it is done, the newest worker is SIGKILLed. Recovery = the
kill → the first ``step`` event after the ``resume`` that follows it. Then the job is stopped.

``--phases`` prints the timeline of each recovery (seconds after the kill): ``survivors_exit``
(the last surviving worker process gone, polled every 5 ms), ``restart`` (the supervisor's event:
it noticed and stops the group), ``rendezvous`` (the group stopped and the next round formed),
``workers_started`` (processes forked or started), ``start`` (rank 0 initialised: process
groups), ``resume`` (checkpoint loaded), ``step`` (the first step after it). Plain torchrun has no supervisor events.

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
from tests import runs

VARIANTS = ("launch", "run", "run-cold", "torchrun")
PHASES = ("survivors_exit", "restart", "rendezvous", "workers_started", "start", "resume", "step")
DEMO = REPO / "configs" / "demo-cpu.toml"
DEMO_DATA = REPO / "runs" / "data" / "demo.bin"


def command(variant: str, a, run_dir: Path, ckpt: Path) -> list[str]:
    opts = ["--standalone", "--nproc-per-node", str(a.nproc), "--max-restarts", "1", "--monitor-interval", "0.1"]
    paths = ["--set", f"run.dir={run_dir}", "--set", f"checkpoint.dir={ckpt}"]
    interval = ["--set", f"checkpoint.interval_steps={a.interval}"]
    if variant == "launch":
        return [*runs.CLI, "launch", str(DEMO), *paths, *interval, "--set", "train.steps=100000", "--set",
                "metrics.port=0", "--set", f"data.path={DEMO_DATA}", *opts]  # fmt: skip
    script_args = [a.script, "--steps", "100000"]
    if variant == "torchrun":  # the script's own --set: the same paths, no supervisor
        return [sys.executable, "-m", "torch.distributed.run", *opts, *script_args, *paths, *interval]
    cold = ["--no-warm-start"] if variant == "run-cold" else []
    return [*runs.CLI, "run", *cold, *paths, *interval, "--set", "metrics.port=0", *opts, *script_args]


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
    found = {}
    for p in descendants(launcher):
        try:
            comm = open(f"/proc/{p}/comm").read().strip()
            cmd = open(f"/proc/{p}/cmdline", "rb").read()
            ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if comm.startswith("et-worker") or (
            os.path.basename(script).encode() in cmd
            and b"torch.distributed.run" not in cmd
            and b"elastic_trainer.cli" not in cmd
        ):
            found[p] = ppid
    return sorted(p for p, ppid in found.items() if ppid not in found)  # not a worker's DataLoader workers


def wait_gone(pids: list[int], timeout: float) -> float | None:
    """time.time() when the last of ``pids`` exited (a zombie counts), polled every 5 ms."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(runs.alive(p) for p in pids):
            return time.time()
        time.sleep(0.005)
    return None


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


def one_run(variant: str, a) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"bench-runrec-{variant}-"))
    run_dir, ckpt = work / "run", work / "ckpt"
    run_dir.mkdir()
    proc = subprocess.Popen(
        command(variant, a, run_dir, ckpt),
        stdout=open(work / "log", "ab"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=runs.env_for_tests(),
        start_new_session=True,
    )
    try:
        runs.wait_event(run_dir, "checkpoint_committed", 300, proc, where=lambda r: r["step"] >= a.interval)
        committed = max(e["step"] for e in runs.read_events(run_dir, "checkpoint_committed"))
        runs.wait_event(run_dir, "step", 120, proc, where=lambda r: r["step"] > committed)
        pids = workers(proc.pid, variant, a.script)
        if len(pids) != a.nproc:
            raise RuntimeError(f"{variant}: found workers {pids} (log {work / 'log'})")
        steps = [e["step_time_s"] for e in runs.read_events(run_dir, "step") if e.get("step_time_s")]
        killed_at = time.time()
        os.kill(pids[-1], signal.SIGKILL)
        survivors_exit = wait_gone(pids[:-1], 60)
        resume = runs.wait_event(run_dir, "resume", 300, proc, where=lambda r: r["time"] > killed_at)
        runs.wait_event(run_dir, "step", 120, proc, where=lambda r: r["time"] > resume["time"])
        phases = timeline(runs.read_events(run_dir), killed_at, survivors_exit)
        started = [e for e in runs.read_events(run_dir, "workers_started") if e["time"] > killed_at]
        out = {
            "variant": variant,
            "recovery_s": phases["step"],
            "median_step_s": median(steps[-20:]) if steps else None,
            "resumed_step": resume["step"],
            "warm": started[0]["warm"] if started else None,
            "phases": phases,
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", default=str(REPO / "examples" / "train_fsdp.py"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--interval", type=int, default=5, help="checkpoint.interval_steps")
    ap.add_argument("--phases", action="store_true", help="print each recovery's timeline")
    ap.add_argument("--json-out")
    a = parse_with_smoke(ap, ["--repeats", "1", "--variants", "run,torchrun", "--interval", "2", "--phases"], argv)
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "torchrun" not in variants:
        raise SystemExit(
            f"--variants: choose from {', '.join(VARIANTS)}, torchrun included (the reference); got {a.variants!r}"
        )
    if "launch" in variants and not DEMO_DATA.exists():
        subprocess.run([*runs.CLI, "data", "build", "--out", str(DEMO_DATA)], check=True, cwd=REPO)
    info = machine_info()
    info["loadavg_start"] = loadavg()
    info["command"] = " ".join(["python", *(sys.argv if argv is None else ["bench/run_recovery.py", *argv])])
    results = []
    for rep in range(a.repeats):
        for v in variants if rep % 2 == 0 else list(reversed(variants)):
            r = one_run(v, a)
            r["repeat"] = rep
            results.append(r)
            print(json.dumps(r), flush=True)
    info["loadavg_end"] = loadavg()
    ref = median(r["recovery_s"] for r in results if r["variant"] == "torchrun")
    rows = []
    for v in variants:
        rs = [r for r in results if r["variant"] == v]
        rec = [r["recovery_s"] for r in rs]
        step = median(r["median_step_s"] for r in rs if r["median_step_s"])
        rows.append(
            [
                v,
                f"**{median(rec):.2f}**",
                ", ".join(f"{x:.2f}" for x in rec),
                f"{step:.3f}",
                f"{median(rec) / step:.1f}",
                f"**{median(rec) / ref:.2f}**",
            ]  # fmt: skip
        )
    print(
        f"\nmachine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}; "
        f"load {info['loadavg_start'][0]:.2f} → {info['loadavg_end'][0]:.2f}"
    )
    print(f"command: {info['command']}\n")
    print(table(["variant", "recovery s (median)", "per run", "median step s", "in steps", "÷ torchrun"], rows))
    if a.phases:
        print("\nper-phase timeline (seconds after the kill, median over repeats):\n")
        prow = []
        for v in variants:
            ph = [r["phases"] for r in results if r["variant"] == v]
            prow.append([v, *(_fmt(median(p[k] for p in ph) if ph[0][k] is not None else None) for k in PHASES)])
        print(table(["variant", *PHASES], prow))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"info": info, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
