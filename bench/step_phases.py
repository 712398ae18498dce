"""Where the step that overlaps a background save loses its time: a per-phase timeline of each step.

    python bench/step_phases.py [--variants 1:omp1:every0,1:omp1:every10] [--steps 100] [--repeats 1]
                                [--max-seconds 60] [--json-out F]

Runs the demo as bench/throughput.py does (same variants ``N[:ompK][:everyM][:process]``), with
bench/step_probe.py recording every step of the worker inside it: the wall time of each phase
(``agree`` = start + the flags' all-reduce; ``forward``; ``backward``; ``clip``; ``wait_staging``
= waiting for the save's stager before the optimizer step; ``check_allreduce``; ``optimizer``;
``tail`` = zero_grad, the scheduler and the step event), the training thread's CPU time, page
faults and involuntary context switches, the CPU time of the worker's other threads, per step.
Steps are grouped by their distance from the last save: ``+1`` is the step that overlaps the
background save (started right after the step before it), ``+2`` the next, ``far`` the others.

Extra variant modifiers: ``:pin`` — the training thread pinned to CPU 0, every other thread of
the worker to CPU 1; ``:idle`` — every thread but the training thread under ``SCHED_IDLE``;
``:hog-save`` / ``:hog-copy`` / ``:hog-fsync`` — a separate process pinned to CPU 1 loops on
what a writer does, without any of this project's code: ``torch.save`` of a 10 MB state dict
(180 tensors) to a file in the run's directory + XXH3 of its bytes; a 10 MB ``copy_``; writing
10 MB to a file and ``fsync``. Use a hog with ``:pin`` (so the training thread stays on CPU 0).
``:switchN``: the worker's ``sys.setswitchinterval`` set to N µs (Python's default: 5000).
``:syncstage``: the stager copies the state on the training thread, inside the save call (no
stager thread). ``:dcpstager``: DCP's ``DefaultStager`` (deep copy on every save) instead of
the kept stager (the comparison before/after it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import throughput
from bench.common import REPO, loadavg, machine_info, median, parse_with_smoke, table

HOGS = {
    "save": "import torch,xxhash,os,sys; torch.set_num_threads(1)\n"
    "sd={f'p{i}': torch.randn(2**16 // 4 * 3) for i in range(180)}\n"
    "f=os.path.join(sys.argv[1],'hog.pt')\n"
    "while True:\n  torch.save(sd, f); xxhash.xxh3_64(open(f,'rb').read()).intdigest()",
    "copy": "import torch; torch.set_num_threads(1); a=torch.empty(10<<18); b=torch.empty(10<<18)\n"
    "while True: a.copy_(b)",
    "fsync": "import os,sys; b=os.urandom(10<<20); f=os.path.join(sys.argv[1],'hog.bin')\n"
    "while True:\n  fd=os.open(f,os.O_WRONLY|os.O_CREAT|os.O_TRUNC); os.write(fd,b); os.fsync(fd); os.close(fd)",
}
PHASES = ["agree", "forward", "backward", "clip", "wait_staging", "check_allreduce", "optimizer", "tail"]
FIELDS = ["gap_before", "save_call_before", "thread_cpu", "minflt", "nivcsw", "nvcsw", "proc_minflt", "others_cpu"]


def split_variant(v: str) -> tuple[str, dict]:
    """The throughput.py part of a variant and this script's modifiers."""
    keep, mods = [], {"pin": False, "idle": False, "hog": None, "switch": "", "syncstage": False, "dcpstager": False}
    for m in v.split(":"):
        if m in ("pin", "idle", "syncstage", "dcpstager"):
            mods[m] = True
        elif m.startswith("switch"):
            mods["switch"] = str(float(m[6:]) / 1e6)
        elif m.startswith("hog-") and m[4:] in HOGS:
            mods["hog"] = m[4:]
        else:
            keep.append(m)
    return ":".join(keep), mods


def group(recs: list[dict], skip: int) -> dict[str, list[dict]]:
    """Steps by distance from the last save started before them (pure)."""
    out: dict[str, list[dict]] = {"+1": [], "+2": [], "far": []}
    since = None
    for r in sorted(recs, key=lambda r: r["step"]):
        since = 1 if r["overlapped"] else None if since is None else since + 1
        if r["step"] <= skip:
            continue
        out["+1" if since == 1 else "+2" if since == 2 else "far"].append(r)
    return out


def one(v: str, steps: int, skip: int, max_seconds: float) -> dict:
    base, mods = split_variant(v)
    probe = Path(tempfile.mkdtemp(prefix="bench-phases-"))
    site = probe / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import bench.step_probe\nbench.step_probe.install()\n")
    saved_env = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(site), os.environ.get("PYTHONPATH", "")])
    os.environ["ET_STEP_PROBE"] = str(probe)
    os.environ["ET_STEP_PROBE_PIN"] = "1" if mods["pin"] else "0"
    os.environ["ET_STEP_PROBE_IDLE"] = "1" if mods["idle"] else "0"
    os.environ["ET_STEP_PROBE_SWITCH"] = mods["switch"]
    os.environ["ET_STEP_PROBE_SYNC_STAGING"] = "1" if mods["syncstage"] else "0"
    os.environ["ET_STEP_PROBE_DCP_STAGER"] = "1" if mods["dcpstager"] else "0"
    hog = None
    if mods["hog"]:
        hog = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", HOGS[mods["hog"]], str(probe)])
        time.sleep(1.0)
    try:
        r = throughput.one_run("configs/demo-cpu.toml", base, steps, skip, [], max_seconds)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        if hog:
            hog.kill()
            hog.wait()
    files = sorted(probe.glob("*.jsonl"), key=lambda p: p.stat().st_size)
    recs = [json.loads(x) for x in files[-1].read_text().splitlines()]
    g = group(recs, skip)
    summary = {}
    for k, rs in g.items():
        summary[k] = {
            "n": len(rs),
            "wall": median(r["wall"] for r in rs),
            **{p: median(r["phases"].get(p, 0.0) for r in rs) for p in PHASES},
            **{f: median(r[f] or 0.0 for r in rs) for f in FIELDS},
        }
    return {"variant": v, "wall_tokens_per_s": r["wall_tokens_per_s"], "groups": summary, "records": recs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="1:omp1:every0,1:omp1:every10")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--skip", type=int, default=11, help="warm-up steps left out (11: also the first save's)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-seconds", type=float, default=60)
    ap.add_argument("--json-out")
    a = parse_with_smoke(ap, ["--variants", "1:omp1:every2", "--steps", "6", "--skip", "1", "--max-seconds", "240"])
    variants = a.variants.split(",")
    for v in variants:
        throughput.parse_variant(split_variant(v)[0])
    info = {**machine_info(), "loadavg_start": loadavg(), "command": " ".join(["python", *sys.argv])}
    runs = []
    for rep in range(a.repeats):
        for v in variants if rep % 2 == 0 else list(reversed(variants)):
            runs.append(one(v, a.steps, a.skip, a.max_seconds))
            print(f"repeat {rep + 1} {v}: {runs[-1]['wall_tokens_per_s']:,.0f} tok/s (wall)", flush=True)
    info["loadavg_end"] = loadavg()
    print(f"\nmachine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}, python {info['python']}")
    print(f"load average start {info['loadavg_start'][0]:.2f}, end {info['loadavg_end'][0]:.2f}")
    print(f"command: {info['command']}\n")
    base_far = None
    rows = []
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        wall = median(r["wall_tokens_per_s"] for r in rs)
        for k in ("far", "+1", "+2"):
            gs = [r["groups"][k] for r in rs if r["groups"][k]["n"]]
            if not gs:
                continue
            m = {f: median(x[f] for x in gs) for f in ["n", "wall", *PHASES, *FIELDS]}
            if base_far is None:
                base_far = m["wall"]
            rows.append(
                [
                    v,
                    k,
                    f"{m['n']:.0f}",
                    f"{m['wall'] * 1000:.0f}",
                    f"{m['wall'] / base_far:.2f}",
                    *(f"{m[p] * 1000:.1f}" for p in PHASES),
                    f"{m['gap_before'] * 1000:.1f}",
                    f"{m['save_call_before'] * 1000:.1f}",
                    f"{m['thread_cpu'] * 1000:.0f}",
                    f"{m['minflt']:.0f}",
                    f"{m['nivcsw']:.0f}",
                    f"{m['nvcsw']:.0f}",
                    f"{m['others_cpu'] * 1000:.0f}",
                    f"{wall:,.0f}" if k == "far" else "",
                ]
            )
    print(
        table(
            [
                "variant",
                "steps",
                "n",
                "step ms",
                f"÷ {variants[0]} far",
                *(f"{p} ms" for p in PHASES),
                "gap before ms",
                "save call before ms",
                "train thread CPU ms",
                "minor faults",
                "invol. switches",
                "vol. switches",
                "other threads CPU ms",
                "wall tok/s",
            ],
            rows,
        )
    )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"info": info, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
