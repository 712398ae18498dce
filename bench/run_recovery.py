"""Recovery of a user's script after SIGKILL of one worker: ``elastic-trainer run`` vs plain ``torchrun``.

    python bench/run_recovery.py [--repeats 3] [--nproc 2] [--variants run,run-cold,torchrun]
                                 [--script examples/train_fsdp.py] [--json-out F]

Side by side in one invocation, order reversed every repeat. Each variant starts the same script
(``examples/train_fsdp.py`` by default, with ``--steps 100000`` so it never ends by itself) with
``--standalone --nproc-per-node N --max-restarts 1 --monitor-interval 0.1``:

* ``run``       ``elastic-trainer run ... SCRIPT`` (warm restarts: workers forked from the zygote)
* ``run-cold``  ``elastic-trainer run --no-warm-start ... SCRIPT`` (workers started as torchrun does)
* ``torchrun``  ``torchrun ... SCRIPT`` (no supervisor)

Once the script has committed a checkpoint (its ``checkpoint_committed`` event, step >= 5) and
done a step past it, the newest worker is SIGKILLed. Recovery = the kill → the first ``step``
event after the ``resume`` that follows it (detect, stop the group, rendezvous, start the
processes, imports, process groups, checkpoint load, one step). Then the job is stopped with
SIGTERM. Prints one line per run and a table of medians, with each variant ÷ ``torchrun``.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import loadavg, machine_info, median, table  # noqa: E402
from tests import runs  # noqa: E402

VARIANTS = ("run", "run-cold", "torchrun")


def command(variant: str, script: str, nproc: int, run_dir: Path, ckpt: Path) -> list[str]:
    opts = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1", "--monitor-interval", "0.1"]
    script_args = [script, "--steps", "100000", "--run-dir", str(run_dir), "--ckpt", str(ckpt)]
    if variant == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *opts, *script_args]
    cold = ["--no-warm-start"] if variant == "run-cold" else []
    return [
        *runs.CLI,
        "run",
        *cold,
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"checkpoint.dir={ckpt}",
        "--set",
        "metrics.port=0",
        *opts,
        *script_args,
    ]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for c in runs.children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def workers(launcher: int, script: str) -> list[int]:
    """The script's worker processes under ``launcher`` (Popen children, or the zygote's forks)."""
    found = []
    for p in descendants(launcher):
        try:
            comm = open(f"/proc/{p}/comm").read().strip()
            cmd = open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            continue
        if comm.startswith("et-worker") or (
            os.path.basename(script).encode() in cmd
            and b"torch.distributed.run" not in cmd
            and b"elastic_trainer.cli" not in cmd
        ):
            found.append(p)
    return sorted(found)


def one_run(variant: str, a) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"bench-runrec-{variant}-"))
    run_dir, ckpt = work / "run", work / "ckpt"
    run_dir.mkdir()
    proc = subprocess.Popen(
        command(variant, a.script, a.nproc, run_dir, ckpt),
        stdout=open(work / "log", "ab"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=runs.env_for_tests(),
        start_new_session=True,
    )
    try:
        runs.wait_event(run_dir, "checkpoint_committed", 300, proc, where=lambda r: r["step"] >= 5)
        committed = max(e["step"] for e in runs.read_events(run_dir, "checkpoint_committed"))
        runs.wait_event(run_dir, "step", 120, proc, where=lambda r: r["step"] > committed)
        pids = workers(proc.pid, a.script)
        if len(pids) != a.nproc:
            raise RuntimeError(f"{variant}: found workers {pids} (log {work / 'log'})")
        killed_at = time.time()
        os.kill(pids[-1], signal.SIGKILL)
        resume = runs.wait_event(run_dir, "resume", 300, proc, where=lambda r: r["time"] > killed_at)
        step = runs.wait_event(run_dir, "step", 120, proc, where=lambda r: r["time"] > resume["time"])
        started = [e for e in runs.read_events(run_dir, "workers_started") if e["time"] > killed_at]
        out = {
            "variant": variant,
            "recovery_s": step["time"] - killed_at,
            "resume_s": resume["time"] - killed_at,
            "resumed_step": resume["step"],
            "warm": started[0]["warm"] if started else None,
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", default=str(REPO / "examples" / "train_fsdp.py"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json-out")
    a = ap.parse_args()
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "torchrun" not in variants:
        raise SystemExit(
            f"--variants: choose from {', '.join(VARIANTS)}, torchrun included (the reference); got {a.variants!r}"
        )
    info = machine_info()
    info["loadavg_start"] = loadavg()
    info["command"] = " ".join(["python", *sys.argv])
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
        rs = [r["recovery_s"] for r in results if r["variant"] == v]
        rows.append([v, f"{median(rs):.2f}", ", ".join(f"{x:.2f}" for x in rs), f"{median(rs) / ref:.2f}"])
    print(
        f"\nmachine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}; "
        f"load {info['loadavg_start'][0]:.2f} → {info['loadavg_end'][0]:.2f}"
    )
    print(f"command: {info['command']}\n")
    print(table(["variant", "recovery s (median)", "per run", "÷ torchrun"], rows))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"info": info, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
