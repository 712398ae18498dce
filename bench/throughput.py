"""Demo throughput (tokens/s) at 1 and 2 workers, and peak memory per rank.

    python bench/throughput.py [--steps 120] [--max-seconds 90] [--repeats 3] [--variants 1,2,1:omp1]
                               [--config configs/demo-cpu.toml] [--set k=v ...] [--json-out F]

Each run is the user's command, unchanged but for a scratch run/checkpoint dir and the step count:

    elastic-trainer launch configs/demo-cpu.toml --nproc-per-node N \
        --set train.steps=S --set run.dir=D --set checkpoint.dir=D/ckpt

(checkpoints stay on, every ``checkpoint.interval_steps`` as in the demo), in the caller's
environment. A variant ``N:ompK`` runs N workers with ``OMP_NUM_THREADS=K`` exported (torchrun
exports ``OMP_NUM_THREADS=1`` itself only when ``nproc_per_node > 1``, so a single worker
otherwise runs torch's default thread pool); ``N:everyM`` saves every M steps (0 = no periodic
save: the throughput cost of checkpointing, side by side); ``N:process`` writes with
``checkpoint.writer = "process"``; ``N:memK`` adds the node-local tier in memory
(``checkpoint.local_dir`` under /dev/shm) with ``checkpoint.remote_every = K``, so a save is an
in-memory copy and every K-th also goes to ``checkpoint.dir`` (``2:every1:mem10``: a copy every
step). The variants' order is reversed every repeat (ABBA) so slow drift in the machine's load
hits all sides. A run still going after ``--max-seconds`` is stopped with SIGTERM (the job
checkpoints and exits 75) and measured on the steps it did.

* tokens/s per step: the ``tokens_per_s`` of each ``step`` event in ``<run.dir>/events.jsonl``
  (global tokens of the step / its wall time on rank 0), median over the steps after
  ``--skip`` warm-up steps; then the median over the repeats.
* wall tokens/s: global tokens of steps ``skip+1..S`` / time between their events; this one
  includes what happens between steps (the async checkpoint calls).
* paired wall ratio: per repeat, a variant's wall tokens/s ÷ that of its *baseline* in the same
  repeat (the runs next to each other in time, so drift in the machine's load over the
  invocation cancels), median over the repeats. A variant's baseline is the first variant
  listed with the same number of workers (list the no-save run first: ``1:omp1:every0,
  1:omp1:every10,2:every0,2:every10`` compares each save run with the no-save run of its
  worker count). The unpaired ratio (medians ÷ median) is printed beside it.
* blocked per save / overlapped step: see :func:`save_overlap` (from the step and
  ``checkpoint_committed`` events). On a GPU node (``train.device = "auto"`` picks CUDA) the
  same command measures the CUDA staging path (device → pinned host).
* CPU of the run: user + system CPU-seconds of the whole process tree (supervisor, workers, writer
  processes: every process reaped), start-up included; *extra CPU per save*: per repeat, the
  run's CPU minus its baseline's (scaled to the same number of steps), ÷ its saves, median over
  the repeats. On cores that training keeps busy, this is the time training loses per save.
* peak RSS per rank: ``VmHWM`` (the kernel's high-water mark of resident memory) of each worker
  process, read from ``/proc/PID/status`` every 0.2 s while it runs (the mark only grows, so the
  last read is the peak up to at most 0.2 s before the process exits); the rank is read from
  the process's ``RANK`` environment variable. Shared pages (torch's libraries) count in each
  rank's RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, TINY_DEMO, loadavg, machine_info, median, parse_with_smoke, table, vm_hwm_bytes
from tests import runs


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return {}
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def _comm(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def _threads(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _children_cpu() -> float:
    """CPU-seconds (user + system) of every process this one has reaped, with what each of those
    reaped in turn: a run's whole process tree (supervisor, workers, writer processes)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def parse_variant(v: str, shm: str = "/dev/shm") -> tuple[int, str | None, int | None, list[str]]:
    """``N[:ompK][:everyM][:process][:memK]`` -> (workers, OMP_NUM_THREADS or None,
    checkpoint.interval_steps or None, extra ``--set`` overrides: ``process`` =
    ``checkpoint.writer=process``; ``memK`` = the node-local tier in memory under ``shm``
    (``checkpoint.local_dir``), checkpoint.dir every K-th save (``checkpoint.remote_every``))."""
    n, *mods = v.split(":")
    omp = every = None
    extra = []
    for m in mods:
        if m.startswith("omp") and m[3:].isdigit():
            omp = m[3:]
        elif m.startswith("every") and m[5:].isdigit():
            every = int(m[5:])
        elif m == "process":
            extra.append("checkpoint.writer=process")
        elif m.startswith("mem") and m[3:].isdigit():
            extra += [f"checkpoint.local_dir={shm}", f"checkpoint.remote_every={m[3:]}"]
        else:
            raise SystemExit(f"--variants: expected N[:ompK][:everyM][:process][:memK], got {v!r}")
    return int(n), omp, every, extra


SAVED = ("checkpoint_committed", "checkpoint_local_saved")  # a step saved to either tier


def save_overlap(by_step: dict[int, dict], saved: set[int], skip: int) -> dict:
    """From a run's step events (pure): the blocked time per save — the median gap between a
    saved step's event and the next step's start, minus the median gap after an unsaved step —
    and the slowdown of the step that overlaps the background write — the median time of a step
    right after a saved one ÷ the median of the other steps. NaN without saves."""
    gap, after, other = {True: [], False: []}, [], []
    for s in sorted(by_step):
        nxt = by_step.get(s + 1)
        if s <= skip or nxt is None:
            continue
        gap[s in saved].append(nxt["time"] - nxt["step_time_s"] - by_step[s]["time"])
        (after if s in saved else other).append(nxt["step_time_s"])
    if not gap[True] or not gap[False]:
        return {"blocked_per_save": float("nan"), "overlapped_step_ratio": float("nan")}
    return {
        "blocked_per_save": median(gap[True]) - median(gap[False]),
        "overlapped_step_ratio": median(after) / median(other),
    }


def one_run(config: str, variant: str, steps: int, skip: int, overrides: list[str], max_seconds: float) -> dict:
    shm = tempfile.mkdtemp(prefix="bench-tput-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    nproc, omp, every, extra = parse_variant(variant, shm)
    work = Path(tempfile.mkdtemp(prefix=f"bench-tput-{nproc}w-"))
    run_dir = work / "run"
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
    ]
    for o in [*overrides, *extra]:
        cmd += ["--set", o]
    if every is not None:
        cmd += ["--set", f"checkpoint.interval_steps={every}"]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    log = open(work / "launch.log", "ab")
    cpu0 = _children_cpu()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
    peak: dict[int, int] = {}
    rank_of: dict[int, int] = {}
    worker_env: dict[str, str] = {}
    threads: dict[int, int] = {}
    sup_peak = 0
    stopped = False
    try:
        while proc.poll() is None:
            if not stopped and time.monotonic() - t0 > max_seconds:
                proc.send_signal(signal.SIGTERM)  # the supervisor forwards it: checkpoint, exit 75
                stopped = True
            if time.monotonic() - t0 > max_seconds + 120:
                raise TimeoutError(f"{variant} run did not stop after SIGTERM (log: {work / 'launch.log'})")
            for pid in runs.worker_pids(proc.pid):
                if pid not in rank_of:
                    e = _environ(pid)
                    comm = _comm(pid)
                    if "RANK" in e:
                        rank_of[pid] = int(e["RANK"])
                    elif comm.startswith("et-worker-") and comm[10:].isdigit():
                        # forked by the warm-start zygote: /proc shows the zygote's start-up environment
                        # (no RANK); the worker names itself et-worker-<local rank> (one node here)
                        rank_of[pid] = int(comm[10:])
                    if pid in rank_of:
                        worker_env = {k: e.get(k, "") for k in ("OMP_NUM_THREADS", "WORLD_SIZE")}
                hwm = vm_hwm_bytes(pid)
                if hwm is not None and pid in rank_of:
                    peak[pid] = max(peak.get(pid, 0), hwm)
                    n = _threads(pid)
                    if n:
                        threads[pid] = max(threads.get(pid, 0), n)
            sup_peak = max(sup_peak, vm_hwm_bytes(proc.pid) or 0)
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            runs.stop(proc)
    wall = time.monotonic() - t0
    cpu = _children_cpu() - cpu0
    if proc.returncode not in (0, 75) or (proc.returncode == 75) != stopped:
        raise RuntimeError(f"{variant} run exited {proc.returncode} (log: {work / 'launch.log'})")
    ev = runs.read_events(run_dir, "step")
    by_step = {e["step"]: e for e in ev}
    kept = [by_step[s] for s in sorted(by_step) if s > skip]
    if len(kept) < 3:
        raise RuntimeError(
            f"{variant}: only {len(by_step)} steps done in {max_seconds}s; raise --max-seconds or lower --skip"
        )
    tps = [e["tokens_per_s"] for e in kept]
    saved = {e["step"] for kind in SAVED for e in runs.read_events(run_dir, kind)}
    overlap = save_overlap(by_step, saved, skip)
    first, last = by_step[skip], by_step[max(by_step)]
    tokens = sum(e["tokens_per_s"] * e["step_time_s"] for e in kept)
    if len({r for r in rank_of.values()}) != nproc:
        raise RuntimeError(f"saw ranks {sorted(rank_of.values())} for {nproc} workers")
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    return {
        "variant": variant,
        "nproc": nproc,
        "stopped_early": stopped,
        "tokens_per_s_median": median(tps),
        "tokens_per_s_p10_p90": [statistics.quantiles(tps, n=10)[0], statistics.quantiles(tps, n=10)[-1]],
        "wall_tokens_per_s": tokens / (last["time"] - first["time"]),
        "step_time_median": median(e["step_time_s"] for e in kept),
        "peak_rss_by_rank": {rank_of[p]: peak[p] for p in peak},
        "threads_by_rank": {rank_of[p]: threads.get(p) for p in peak},
        "supervisor_peak_rss": sup_peak,
        "worker_env": worker_env,
        "launch_wall_seconds": wall,
        "cpu_seconds": cpu,
        "saves": len(saved),
        **overlap,
        "steps": len(by_step),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo-cpu.toml")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the statistics")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="1,2,1:omp1", help="worker counts, N or N:ompK (OMP_NUM_THREADS=K)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument(
        "--max-seconds", type=float, default=90, help="stop a run (SIGTERM) after this long; measured on the steps done"
    )
    ap.add_argument("--json-out")
    a = parse_with_smoke(ap, ["--steps", "6", "--skip", "1", "--repeats", "1", "--variants", "1", *TINY_DEMO])
    data = REPO / "runs/data/demo.bin"
    if not data.exists():
        subprocess.run([*runs.CLI, "data", "build", "--out", str(data)], check=True, cwd=REPO, env=runs.env_for_tests())
    variants = a.variants.split(",")
    for v in variants:
        parse_variant(v)
    info = machine_info()
    info["loadavg_start"] = loadavg()
    info["command"] = " ".join(["python", *sys.argv])
    t0 = time.monotonic()
    results: list[dict] = []
    for rep in range(a.repeats):
        order = variants if rep % 2 == 0 else list(reversed(variants))
        for v in order:
            r = one_run(a.config, v, a.steps, a.skip, a.overrides, a.max_seconds)
            r["repeat"] = rep
            results.append(r)
            print(
                f"repeat {rep + 1} {v} ({r['steps']} steps{', stopped' if r['stopped_early'] else ''}): "
                f"{r['tokens_per_s_median']:,.0f} tok/s (step median), {r['wall_tokens_per_s']:,.0f} tok/s (wall), "
                "peak RSS "
                f"{', '.join(f'rank {k} {v / 2**20:.0f} MiB' for k, v in sorted(r['peak_rss_by_rank'].items()))}",
                flush=True,
            )
    info["loadavg_end"] = loadavg()
    info["wall_seconds"] = round(time.monotonic() - t0, 1)
    summary = {}
    baseline = {}  # workers -> the first variant listed with that many
    for v in variants:
        baseline.setdefault(parse_variant(v)[0], v)
    base_of = {(r["nproc"], r["repeat"]): r for r in results if r["variant"] == baseline[r["nproc"]]}
    for v in variants:
        n = parse_variant(v)[0]
        rs = [r for r in results if r["variant"] == v]
        paired = [r["wall_tokens_per_s"] / base_of[(n, r["repeat"])]["wall_tokens_per_s"] for r in rs]
        # the process tree's CPU beyond its baseline's (scaled to the same steps), per save
        cpu_per_save = [
            (r["cpu_seconds"] - (b := base_of[(n, r["repeat"])])["cpu_seconds"] * r["steps"] / b["steps"]) / r["saves"]
            for r in rs
            if r["saves"]
        ]
        summary[v] = {
            "nproc": n,
            "baseline": baseline[n],
            "tokens_per_s": median(r["tokens_per_s_median"] for r in rs),
            "tokens_per_s_runs": [r["tokens_per_s_median"] for r in rs],
            "wall_tokens_per_s": median(r["wall_tokens_per_s"] for r in rs),
            "wall_paired_ratio": median(paired),
            "wall_paired_ratios": paired,
            "cpu_seconds": median(r["cpu_seconds"] for r in rs),
            "extra_cpu_per_save": median(cpu_per_save) if cpu_per_save else float("nan"),
            "step_time": median(r["step_time_median"] for r in rs),
            "peak_rss_by_rank_max": {k: max(r["peak_rss_by_rank"][k] for r in rs) for k in range(n)},
            "peak_rss_by_rank_median": {k: median(r["peak_rss_by_rank"][k] for r in rs) for k in range(n)},
            "supervisor_peak_rss": max(r["supervisor_peak_rss"] for r in rs),
            "worker_env": rs[0]["worker_env"],
            "threads": rs[0]["threads_by_rank"],
            "blocked_per_save": median(r["blocked_per_save"] for r in rs),
            "overlapped_step_ratio": median(r["overlapped_step_ratio"] for r in rs),
        }
    print()
    print(
        f"machine: {info['nproc']} CPUs ({info['cpu']}), "
        f"{info['mem_total_gib']} GiB, torch {info['torch']}, python {info['python']}"
    )
    print(
        f"load average start {'/'.join(f'{x:.2f}' for x in info['loadavg_start'])}, "
        f"end {'/'.join(f'{x:.2f}' for x in info['loadavg_end'])}; wall {info['wall_seconds']}s"
    )
    print(
        f"command: {info['command']}  ({a.repeats} runs per worker count, "
        f"{a.steps} steps each, first {a.skip} left out)"
    )
    print()
    rows = []
    for v in variants:
        s = summary[v]
        n = s["nproc"]
        base, wall_base = summary[s["baseline"]]["tokens_per_s"], summary[s["baseline"]]["wall_tokens_per_s"]
        rss = ", ".join(f"{s['peak_rss_by_rank_max'][k] / 2**20:.0f}" for k in range(n))
        rows.append(
            [
                v,
                s["baseline"],
                f"{s['tokens_per_s']:,.0f}",
                ", ".join(f"{x:,.0f}" for x in s["tokens_per_s_runs"]),
                f"{s['tokens_per_s'] / base:.2f}",
                f"{s['wall_tokens_per_s']:,.0f}",
                f"{s['wall_tokens_per_s'] / wall_base:.3f}",
                f"{s['wall_paired_ratio']:.3f}",
                ", ".join(f"{x:.3f}" for x in s["wall_paired_ratios"]),
                f"{s['blocked_per_save'] * 1000:.1f}",
                f"{s['cpu_seconds']:.1f}",
                f"{s['extra_cpu_per_save'] * 1000:.0f}",
                f"{s['overlapped_step_ratio']:.2f}",
                f"{s['step_time'] * 1000:.0f}",
                rss,
                f"{s['supervisor_peak_rss'] / 2**20:.0f}",
                s["worker_env"].get("OMP_NUM_THREADS") or "unset",
            ]
        )
    print(
        table(
            [
                "variant",
                "baseline",
                "tokens/s (median)",
                "per run",
                "÷ baseline",
                "wall tokens/s",
                "wall ÷ baseline",
                "wall ÷ baseline, paired (median)",
                "paired per repeat",
                "blocked ms per save",
                "CPU-s of the run (all processes)",
                "extra CPU-ms per save (paired)",
                "overlapped step ÷ median step",
                "step ms",
                "peak RSS per rank MiB (max of runs)",
                "supervisor peak RSS MiB",
                "OMP_NUM_THREADS in worker",
            ],
            rows,
        )
    )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"info": info, "summary": summary, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
