"""Where a worker's threads hold the interpreter lock while checkpoints are written (py-spy).

    python bench/save_gil.py [--variants 1:omp1,2,1:omp1:process] [--seconds 25] [--rate 250]
                             [--config configs/demo-cpu.toml] [--set k=v ...] [--json-out F]

Needs ``py-spy`` (``pip install py-spy``) and permission to ptrace the workers. For each
variant (``N[:ompK][:process]``, as in ``bench/throughput.py``) runs the user's command

    elastic-trainer launch CONFIG --nproc-per-node N --set checkpoint.interval_steps=10 ...

and, once rank 0 has done ``--warmup`` steps, samples rank 0 twice for ``--seconds`` each:

* ``py-spy record --gil --threads``: only samples of the thread that holds the GIL — the GIL's
  owner over time, per thread and per category of work;
* ``py-spy record --idle --threads``: every thread's stack at every sample — the wall-clock
  profile of each thread, including where the training thread waits.

Every stack is put in the first category whose marker appears in it, scanned from the innermost
frame outwards (see ``CATEGORIES``). Prints, per variant, the share of GIL samples per thread and
per category, and the number of saves that fell inside the window (from the event log).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, TINY_DEMO, loadavg, machine_info, parse_with_smoke, table
from bench.throughput import parse_variant
from tests import runs

# (category, markers): a frame "function (file:line)" matches when a marker is a substring of it.
CATEGORIES = (
    ("checksums (XXH3)", ("checkpoint/integrity.py", "xxhash")),
    ("manifest / commit", ("checkpoint/catalog.py", "checkpoint/layout.py", "checkpoint/local_tier.py")),
    ("fsspec", ("fsspec/",)),
    ("serialisation (torch.save)", ("torch/serialization.py", "_write_item", "_serialize")),
    ("metadata (.metadata pickle, finish)", ("finish (", "_write_metadata", "pickle")),
    (
        "planning",
        ("planner", "_dedup", "create_local_plan", "create_global_plan", "reduce_scatter", "_save_state_dict"),
    ),
    ("staging copy", ("staging.py", "_copy_state_dict", "_create_cpu_state_dict", "_offload_state_dict")),
    ("state-dict traversal", ("state_dict.py", "get_state_dict", "state_dict (")),
    ("collectives", ("distributed_c10d.py", "all_gather", "broadcast", "barrier")),
    ("forward / backward / optimizer", ("torch/autograd", "torch/nn/", "torch/optim", "fsdp", "_fsdp")),
)


def categorise(frames: list[str]) -> str:
    for frame in reversed(frames):  # innermost first
        for name, markers in CATEGORIES:
            if any(m in frame for m in markers):
                return name
    return "other"


def thread_role(frames: list[str]) -> str:
    """training / writer / stager / commit / other, from the thread's stack or name."""
    joined = ";".join(frames)
    tname = frames[0] if frames else ""
    if "ckpt-commit" in tname or "_commit (" in joined:
        return "commit"
    if (
        "AsyncCheckpointExecutor" in tname
        or "et-upload" in tname
        or "et-local-upload" in tname
        or "_execute_save_impl" in joined
        or "save_wrapper" in joined
        or "_async_save" in joined
    ):
        return "writer"
    if "staging" in joined or "stager" in tname.lower():
        return "stager"
    if "<module> (" in joined and ("runpy" in joined or "main.py" in joined) and "_bootstrap" not in joined:
        return "training"
    return "other"


def parse_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy ``--format raw``: ``frame;frame;... count`` per line (outermost frame first)."""
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r"^(.*) (\d+)$", line)
        if m:
            out.append((m.group(1).split(";"), int(m.group(2))))
    return out


def summarise(samples: list[tuple[list[str], int]]) -> dict:
    by_role: collections.Counter = collections.Counter()
    by_cat: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for frames, n in samples:
        role = thread_role(frames)
        by_role[role] += n
        by_cat[role][categorise(frames)] += n
        leaves[role][" < ".join(f.split(" (")[0] for f in reversed(frames[-3:]))] += n
    return {
        "total": sum(by_role.values()),
        "by_role": dict(by_role),
        "by_category": {r: dict(c) for r, c in by_cat.items()},
        "top_leaves": {r: c.most_common(8) for r, c in leaves.items()},
    }


def record(pid: int, seconds: float, rate: int, out: Path, mode: str) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    flag = "--gil" if mode == "gil" else "--idle"
    subprocess.run(
        [
            spy,
            "record",
            flag,
            "--threads",
            "--nonblocking",
            "--format",
            "raw",
            "-r",
            str(rate),
            "-d",
            str(int(seconds)),
            "-p",
            str(pid),
            "-o",
            str(out),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def one_variant(config: str, variant: str, a) -> dict:
    nproc, omp, _, extra = parse_variant(variant)
    work = Path(tempfile.mkdtemp(prefix="bench-gil-"))
    run_dir = work / "run"
    steps = a.warmup + int(2 * a.seconds * 10) + 200  # never runs out before the samples are taken
    cmd = [
        *runs.CLI,
        "launch",
        config,
        "--nproc-per-node",
        str(nproc),
        "--set",
        f"train.steps={steps}",
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        "--set",
        f"checkpoint.interval_steps={a.every}",
    ]
    for o in [*a.overrides, *extra]:
        cmd += ["--set", o]
    env = runs.env_for_tests()
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    else:
        env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.Popen(
        cmd, stdout=open(work / "launch.log", "ab"), stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
    )
    result: dict = {"variant": variant}
    try:
        runs.wait_for(
            lambda: any(e["step"] >= a.warmup for e in runs.read_events(run_dir, "step")),
            300,
            f"{variant}: {a.warmup} steps",
        )
        pids = sorted(runs.worker_pids(proc.pid))
        rank0 = pids[0]  # the first forked worker (rank 0 under this launcher)
        for mode in ("gil", "idle"):
            t0 = time.time()
            out = work / f"{mode}.txt"
            record(rank0, a.seconds, a.rate, out, mode)
            saves = [e for e in runs.read_events(run_dir, "checkpoint_committed") if t0 <= e["time"] <= time.time()]
            result[mode] = summarise(parse_raw(out))
            result[mode]["saves_in_window"] = len(saves)
            result[mode]["seconds"] = a.seconds
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                runs.stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    return result


def print_variant(r: dict) -> None:
    g, w = r["gil"], r["idle"]
    print(
        f"\n### {r['variant']}: GIL samples {g['total']} in {g['seconds']}s ({g['saves_in_window']} saves); "
        f"wall samples {w['total']} ({w['saves_in_window']} saves)"
    )
    rows = []
    for role in sorted(g["by_role"], key=lambda k: -g["by_role"][k]):
        cats = sorted(g["by_category"][role].items(), key=lambda kv: -kv[1])
        rows.append(
            [
                role,
                f"{g['by_role'][role]} ({g['by_role'][role] / g['total']:.1%})",
                "; ".join(f"{c} {n}" for c, n in cats[:6]),
            ]
        )
    print(table(["thread", "GIL samples (share)", "by category"], rows))
    rows = []
    for role in sorted(w["by_role"], key=lambda k: -w["by_role"][k]):
        cats = sorted(w["by_category"][role].items(), key=lambda kv: -kv[1])
        rows.append([role, w["by_role"][role], "; ".join(f"{c} {n}" for c, n in cats[:6])])
    print(table(["thread", "wall samples", "by category (incl. idle)"], rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo-cpu.toml")
    ap.add_argument("--variants", default="1:omp1,2")
    ap.add_argument("--every", type=int, default=10, help="checkpoint.interval_steps")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--seconds", type=float, default=25)
    ap.add_argument("--rate", type=int, default=250, help="samples per second")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json-out")
    a = parse_with_smoke(ap, ["--variants", "2", "--warmup", "2", "--seconds", "1", "--every", "2", *TINY_DEMO])
    spy = shutil.which("py-spy") or Path(sys.executable).with_name("py-spy")
    if a.smoke and not os.path.exists(spy):
        print("py-spy is not installed: nothing to sample (smoke run skipped)")
        return 0
    info = machine_info()
    info["loadavg_start"] = loadavg()
    info["command"] = " ".join(["python", *sys.argv])
    results = [one_variant(a.config, v, a) for v in a.variants.split(",")]
    info["loadavg_end"] = loadavg()
    print(
        f"machine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}; "
        f"load {info['loadavg_start'][0]:.2f} → {info['loadavg_end'][0]:.2f}"
    )
    print(f"command: {info['command']}")
    for r in results:
        print_variant(r)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"info": info, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
