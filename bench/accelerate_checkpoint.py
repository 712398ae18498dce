"""An Accelerate loop's checkpoints: Accelerate's own ``save_state`` against elastic_trainer's
(``from elastic_trainer.accelerate import Accelerator``), side by side in one invocation.

Each variant trains the same Llama (``--hidden``/``--layers``/``--seq``) for ``--warmup`` +
``--steps`` optimizer steps on ``--nproc`` CPU workers (gloo), each variant a fresh launch,
variants interleaved over ``--repeats`` rounds:

* ``accelerate`` / ``accelerate+save``: Accelerate's ``Accelerator`` under ``torchrun``, no saves /
  its ``save_state()`` every ``--every`` steps (synchronous);
* ``ours`` / ``ours+save``: ``elastic_trainer.accelerate.Accelerator`` under ``elastic-trainer run``
  (``checkpoint.writer = --writer``), no saves / ``save_state()`` every ``--every`` steps (async).

Reported, as in bench/lightning_checkpoint.py:

* training blocked per save, the slowest rank of each save, median over saves: Accelerate's, the
  ``save_state()`` call; ours, the save call plus the next optimizer step's wait for the staging
  copy (and any wait for the previous save), as the checkpoint manager records it. A step that
  is slower because the writer shares the cores is not counted here: that is throughput;
* throughput: the wall time of the ``--steps`` steps after the warm-up, no saves ÷ a save every
  ``--every`` steps, per integration (and ours without saves ÷ Accelerate's without saves);
* time to resume: ``load_state()`` of what the run saved, in a new launch.

Separate launches drift apart on a shared machine (the same no-save window moved by a third
between launches), more than the few per cent a save costs. ``--paired`` measures the
throughput inside one launch instead: after the warm-up (one save, drained, untimed), each
launch alternates ``--windows`` windows of ``--every`` optimizer steps with a save and as many
without one, in the order save, plain, plain, save, save, plain, ... (a linear drift over the
launch cancels out). Every window starts after a barrier of all ranks. A save window calls
``save_state()`` at its first step boundary and runs its ``--every`` steps; for ours the
window then waits (``drain``) until the save is written on every rank and committed, so no
save's work lands in the next window. The ratio is the plain windows' total time ÷ the save
windows' (each window's time is its slowest rank's), with the drain counted in the save windows
(all the work a save causes) and without it. Each window also records the CPU seconds of every
rank's process and of its child processes (the writer process), and of the whole machine
(``/proc/stat``): what the save costs in CPU, and whether the cores were saturated. Launches:
Accelerate's own, then ours with each writer (``--writer``, default both in this mode), in a
rotating order over ``--repeats`` (``--steps`` is not used).

    python bench/accelerate_checkpoint.py                 # the BENCHMARKS.md configuration
    python bench/accelerate_checkpoint.py --paired        # throughput, paired in each launch
    python bench/accelerate_checkpoint.py --smoke         # seconds: each code path once, ours paired
                                                          # too (one worker, a tiny model; the ratios
                                                          # are not figures)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, loadavg, machine_info, median, record_saves, table

VARIANTS = ("accelerate", "accelerate+save", "ours", "ours+save")
OPTIONS = ("steps", "warmup", "every", "windows", "hidden", "layers", "seq", "batch")  # passed to the workers


def worker(a: argparse.Namespace) -> None:
    """One rank of one variant (under its launcher): train, time every step (``--paired``: every
    window), write the timings to ``timing-<rank>.json`` in ``--work`` (``--resume``: time
    ``load_state()`` instead)."""
    import torch
    from accelerate.utils import ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    ours, saving = a.variant.startswith("ours"), a.variant.endswith("+save")
    recorded = record_saves() if ours and saving else []  # ours: the manager's record per save
    if ours:
        from elastic_trainer.accelerate import Accelerator
    else:
        from accelerate import Accelerator
    work = Path(a.work)
    pc = ProjectConfiguration(project_dir=str(work / "acc"), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=pc, cpu=True)
    set_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=a.seq,
    )
    model = LlamaForCausalLM(cfg)
    total = a.warmup + (2 * a.windows * a.every if a.paired else a.steps)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (a.batch * (total + 1), a.seq), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]
    loader = DataLoader(data, batch_size=a.batch // acc.num_processes, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, loader)
    rank = acc.process_index
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch

    def train_step() -> None:
        acc.backward(model(**next(batches)).loss)
        opt.step()
        opt.zero_grad()

    if a.resume:
        t0 = time.perf_counter()
        acc.load_state()
        out = {"resume_s": time.perf_counter() - t0}
    elif a.paired:
        out = paired_windows(acc, train_step, a, ours, recorded)
    else:
        calls, ends = [], []
        for step in range(1, total + 1):
            train_step()
            if saving and step % a.every == 0:
                c0 = time.perf_counter()
                acc.save_state()
                calls.append(time.perf_counter() - c0)
            ends.append(time.perf_counter())
        # ours: per save, the call + the next step's staging wait
        blocked = [s.stall for s in recorded] if recorded else calls
        parts = [[s.wait_previous, s.call, s.staging_wait] for s in recorded]  # ours: where the blocked time went
        state_mb = sum(t.numel() * t.element_size() for t in model.parameters()) / 1e6
        state_mb += (
            sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
            / 1e6
        )
        out = {"wall": ends[total - 1] - ends[a.warmup - 1], "blocked": blocked, "parts": parts, "state_mb": state_mb}
    acc.end_training()
    (work / f"timing-{rank}.json").write_text(json.dumps(out))
    # Done: skip the teardown, where freeing the DDP model's gloo group after end_training() can hang
    # (seen once in a dozen launches of Accelerate's own: ~ProcessGroupGloo joining its threads).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cpu_seconds() -> tuple[float, float, float, float]:
    """CPU seconds (user + system) so far: this thread (the training loop's), this process's other
    threads (stager, thread writer, commit; gloo's), its child processes (the process writer), the
    whole machine (``/proc/stat``, every process of every user)."""
    tick = os.sysconf("SC_CLK_TCK")
    me, children = str(os.getpid()), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[1] == me:  # ppid; then utime, stime are fields 14, 15 of stat(5)
            children += int(fields[11]) + int(fields[12])
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    main = time.thread_time()
    return main, time.process_time() - main, children / tick, (user + nice + system + irq + softirq + steal) / tick


def paired_windows(acc, train_step, a: argparse.Namespace, ours: bool, recorded: list) -> dict:
    """``--paired``: the warm-up (one save after its first step, drained), then ``--windows``
    save windows and as many plain windows of ``--every`` steps each (the module's docstring).
    Per window: its kind, wall seconds, the drain after it (ours: the wait for the save's
    commit), CPU seconds of the training thread, of this process's other threads, of its child
    processes, and the machine's."""

    def drain() -> float:
        """Ours: end the step (its agreement), then wait until the save in flight is written on
        every rank and committed (rank 0). Accelerate's save is done when its call returns."""
        t0 = time.perf_counter()
        if ours:
            acc._end_step()  # noqa: SLF001 - the bench measures inside: the step's agreement
            acc._run.manager.finish()  # noqa: SLF001 - the integration has no public wait for a commit
        return time.perf_counter() - t0

    train_step()
    acc.save_state()
    for _ in range(a.warmup - 1):
        train_step()
    drain()
    kinds = [k for i in range(a.windows) for k in (("save", "plain") if i % 2 == 0 else ("plain", "save"))]
    windows, calls = [], []
    for kind in kinds:
        acc.wait_for_everyone()
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        if kind == "save":
            acc.save_state()
            calls.append(time.perf_counter() - t0)
        for _ in range(a.every):
            train_step()
        if ours:
            acc._end_step()  # noqa: SLF001 - the last step's agreement, as the next batch would do it
        wall = time.perf_counter() - t0
        waited = drain() if kind == "save" else 0.0
        c1 = cpu_seconds()
        main, threads, children, machine = (x1 - x0 for x0, x1 in zip(c0, c1, strict=True))
        windows.append(
            {"kind": kind, "wall": wall, "drain": waited, "main": main, "threads": threads}
            | {"children": children, "machine": machine}
        )
    # blocked per save (ours: the manager's record, the warm-up save left out)
    blocked = [s.stall for s in recorded[1:]] if ours else calls
    return {"windows": windows, "blocked": blocked}


def launcher(variant: str, a: argparse.Namespace, work: Path, writer: str) -> list[str]:
    """Accelerate's variants under torchrun (what ``accelerate launch --multi_cpu`` runs; a world of
    one: ``python script.py``); ours under the supervisor with ``checkpoint.writer = writer``."""
    common = ["--nproc-per-node", str(a.nproc), "--monitor-interval", "0.2"]
    if not variant.startswith("ours"):
        return [sys.executable, *(["-m", "torch.distributed.run", "--standalone", *common] if a.nproc > 1 else [])]
    sets = {
        "run.dir": work / "acc",
        "checkpoint.dir": work / "acc" / "checkpoints",
        "metrics.port": 0,
        "checkpoint.writer": writer,
        "checkpoint.keep_last": 2,
    }
    return [sys.executable, "-m", "elastic_trainer.cli", "run", *(f"--set={k}={v}" for k, v in sets.items()), *common]


def run(variant: str, a: argparse.Namespace, work: Path, writer: str, resume: bool = False) -> list[dict]:
    args = [*launcher(variant, a, work, writer), __file__, "--worker", "--variant", variant, "--work", str(work)]
    args += [f"--{k}={getattr(a, k)}" for k in OPTIONS] + (["--resume"] if resume else [])
    args += ["--paired"] if a.paired and not resume else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{variant}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    ranks = [json.loads((work / f"timing-{i}.json").read_text()) for i in range(a.nproc)]
    for i in range(a.nproc):
        (work / f"timing-{i}.json").unlink()
    return ranks


def separate_launches(a: argparse.Namespace, root: str, variants: tuple[str, ...], resumed: tuple[str, ...]) -> dict:
    """The four variants, each its own launch, interleaved over the repeats; the saving ones
    resumed in a new launch."""
    res: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
    resume: dict[str, list[float]] = {v: [] for v in VARIANTS if v.endswith("+save")}
    for _ in range(a.repeats):
        for v in variants:
            work = Path(tempfile.mkdtemp(prefix=v.replace("+", "-") + "-", dir=root))
            res[v].append(run(v, a, work, a.writer))
            if v in resumed:
                resume[v].append(max(r["resume_s"] for r in run(v, a, work, a.writer, resume=True)))
            shutil.rmtree(work, ignore_errors=True)
    wall = {v: median(max(r["wall"] for r in ranks) for ranks in res[v]) for v in VARIANTS}
    blocked = {
        v: median(max(b) for ranks in res[v] for b in zip(*(r["blocked"] for r in ranks), strict=True)) for v in resume
    }
    ratio = {n: wall[n] / wall[n + "+save"] for n in ("accelerate", "ours")}
    rows = [
        [n, f"{blocked[n + '+save']:.3f}", f"{wall[n]:.2f}", f"{wall[n + '+save']:.2f}", f"{ratio[n]:.3f}"]
        + [f"{median(resume[n + '+save']):.2f}"]
        for n in ("accelerate", "ours")
    ]
    head = ["integration", "blocked per save (s)", "window, no saves (s)", f"window, save every {a.every} (s)"]
    print(table([*head, "no saves ÷ saves", "load_state (s)"], rows))
    return {
        "state_mb_per_rank": res["ours+save"][0][0]["state_mb"],
        "wall_seconds": wall,
        "blocked_per_save_seconds": blocked,
        "blocked_ratio_ours_over_accelerate": blocked["ours+save"] / blocked["accelerate+save"],
        "ours_blocked_parts_median_seconds": {  # per rank and save: wait for the previous save, call, staging wait
            k: median(p[i] for ranks in res["ours+save"] for r in ranks for p in r["parts"])
            for i, k in enumerate(("wait_previous", "call", "staging_wait"))
        },
        "throughput_with_saves_over_none": ratio,
        "ours_over_accelerate_no_saves": wall["accelerate"] / wall["ours"],
        "resume_ratio_ours_over_accelerate": median(resume["ours+save"]) / median(resume["accelerate+save"]),
    }


def paired_summary(ranks: list[dict]) -> dict:
    """One paired launch: each window's time is its slowest rank's; the ratio is the plain
    windows' total ÷ the save windows' (with their drains; ``ratio_steps_only``: without)."""
    per_window = list(zip(*(r["windows"] for r in ranks), strict=True))
    kinds = [w[0]["kind"] for w in per_window]
    steps = [max(r["wall"] for r in w) for w in per_window]
    full = [max(r["wall"] + r["drain"] for r in w) for w in per_window]
    plain = [t for t, k in zip(steps, kinds, strict=True) if k == "plain"]
    save = [t for t, k in zip(full, kinds, strict=True) if k == "save"]
    save_steps = [t for t, k in zip(steps, kinds, strict=True) if k == "save"]

    def mean(kind: str, f) -> float:  # per window of that kind
        return statistics.fmean(f(w) for w, k in zip(per_window, kinds, strict=True) if k == kind)

    cpu = {  # per window, over the ranks: CPU seconds of the training threads, of the other threads,
        # of the writer processes; the machine's
        k: {
            "wall": mean(k, lambda w: max(r["wall"] + r["drain"] for r in w)),
            "main": mean(k, lambda w: sum(r["main"] for r in w)),
            "threads": mean(k, lambda w: sum(r["threads"] for r in w)),
            "writers": mean(k, lambda w: sum(r["children"] for r in w)),
            "machine": mean(k, lambda w: w[0]["machine"]),
        }
        for k in ("save", "plain")
    }
    ours = {k: c["main"] + c["threads"] + c["writers"] for k, c in cpu.items()}
    others = {k: c["machine"] - ours[k] for k, c in cpu.items()}  # every other process, per window
    # on cores 100 % busy, the time the other processes took from a window: their CPU ÷ the cores
    alone = {k: c["wall"] - others[k] / (os.cpu_count() or 1) for k, c in cpu.items()}
    return {
        "ratio": sum(plain) / sum(save),
        "ratio_steps_only": sum(plain) / sum(save_steps),
        "pairs": [p / s for p, s in zip(plain, save, strict=True)],  # the i-th plain window ÷ the i-th save window
        "plain_s": sum(plain),
        "save_s": sum(save),
        "drain_s": sum(save) - sum(save_steps),
        "blocked_s": median(max(b) for b in zip(*(r["blocked"] for r in ranks), strict=True)),
        "cpu_per_window": cpu,
        # the training's own CPU (ranks and writers) without a save ÷ with one: what the save costs
        # in CPU, which the other processes on the machine do not move
        "cpu_ratio": ours["plain"] / ours["save"],
        "others_cpu": others,
        "ratio_others_out": alone["plain"] / alone["save"],  # the ratio with the other processes' CPU taken out
    }


def paired_launches(a: argparse.Namespace, root: str, names: list[str]) -> dict:
    """``--paired``: a launch per name (``accelerate``, ``ours/<writer>``), their order rotated
    each repeat."""
    res: dict[str, list[dict]] = {n: [] for n in names}
    walls, cpus = [], []
    ncpu = os.cpu_count()
    for i in range(a.repeats):
        for n in names[i % len(names) :] + names[: i % len(names)]:
            variant, _, writer = n.partition("/")
            work = Path(tempfile.mkdtemp(prefix=variant + "-", dir=root))
            load0 = loadavg()[0]
            s = paired_summary(run(variant, a, work, writer))
            s["load"] = [load0, loadavg()[0]]
            shutil.rmtree(work, ignore_errors=True)
            res[n].append(s)
            c, o = s["cpu_per_window"], s["others_cpu"]
            walls.append(
                [n, i + 1, f"{load0:.1f} → {s['load'][1]:.1f}", f"{s['plain_s']:.2f}", f"{s['save_s']:.2f}"]
                + [f"{s['drain_s']:.3f}", f"**{s['ratio']:.3f}**", f"{min(s['pairs']):.3f}–{max(s['pairs']):.3f}"]
                + [f"**{s['ratio_others_out']:.3f}**"]
                + [f"{1000 * s['blocked_s']:.1f}"]
            )
            cpus.append(
                [n, i + 1, *(f"{c['save'][x]:.2f} / {c['plain'][x]:.2f}" for x in ("main", "threads", "writers"))]
                + [f"**{s['cpu_ratio']:.3f}**"]
                + [f"{o['save']:.2f} / {o['plain']:.2f}"]
                + ["{:.0f} / {:.0f}".format(*(100 * c[k]["machine"] / (c[k]["wall"] * ncpu) for k in c))]
            )
    head = ["launch", "repeat", "load", f"{a.windows} plain windows (s)", f"{a.windows} save windows (s)"]
    head += ["of which drain (s)", "plain ÷ save", "per pair", "other processes' CPU taken out"]
    print(table([*head, "blocked per save (ms)"], walls))
    head = ["launch", "repeat", "CPU per window, save / plain (s): training threads", "other threads"]
    head += ["writer processes"]
    head += ["CPU, plain ÷ save", "other processes' CPU (s)", "machine busy %"]
    print(table(head, cpus))
    summary = {
        n: {
            "ratio_median": median(s["ratio"] for s in res[n]),
            "ratio_min": min(s["ratio"] for s in res[n]),
            "ratio_max": max(s["ratio"] for s in res[n]),
            "ratio_pooled": sum(s["plain_s"] for s in res[n]) / sum(s["save_s"] for s in res[n]),
            "pairs_min": min(min(s["pairs"]) for s in res[n]),
            "pairs_max": max(max(s["pairs"]) for s in res[n]),
            "cpu_ratio_median": median(s["cpu_ratio"] for s in res[n]),
            "others_out_median": median(s["ratio_others_out"] for s in res[n]),
            "others_out_min": min(s["ratio_others_out"] for s in res[n]),
            "others_out_max": max(s["ratio_others_out"] for s in res[n]),
        }
        for n in names
    }
    head = ["launch", "plain ÷ save, median", "min–max over repeats", "all repeats pooled", "per pair, min–max"]
    head += ["other processes' CPU taken out, median", "min–max"]
    rows = [
        [n, f"{v['ratio_median']:.3f}", f"{v['ratio_min']:.3f}–{v['ratio_max']:.3f}", f"{v['ratio_pooled']:.3f}"]
        + [f"{v['pairs_min']:.3f}–{v['pairs_max']:.3f}", f"**{v['others_out_median']:.3f}**"]
        + [f"{v['others_out_min']:.3f}–{v['others_out_max']:.3f}"]
        for n, v in summary.items()
    ]
    print(table(head, rows))
    return {"launches": res, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--paired", action="store_true", help="throughput: save and plain windows paired in each launch")
    ap.add_argument("--steps", type=int, default=40, help="measured steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--every", type=int, default=10, help="save every N steps (--paired: steps per window)")
    ap.add_argument("--windows", type=int, default=4, help="--paired: save windows (and as many plain ones)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over the workers)")
    ap.add_argument("--nproc", type=int, default=2, help="workers (gloo, CPU)")
    ap.add_argument(
        "--writer", choices=("thread", "process"), help="ours: checkpoint.writer (default: process; --paired: both)"
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--smoke", action="store_true", help="tiny and fast: the harness works")
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    variants, resumed = VARIANTS, ("accelerate+save", "ours+save")
    writers = (a.writer,) if a.writer else ("process", "thread")
    a.writer = a.writer or "process"
    paired = ["accelerate", *(f"ours/{w}" for w in writers)]
    if a.smoke:  # each code path once: both integrations saving, our resume, ours paired; one worker, a tiny model
        a.steps, a.warmup, a.every, a.windows, a.hidden, a.layers, a.seq, a.batch = 4, 2, 2, 1, 32, 1, 16, 2
        a.nproc, a.repeats, a.writer = 1, 1, "thread"
        variants, resumed, paired = ("accelerate+save", "ours+save"), ("ours+save",), ["ours/thread"]
    if a.paired and a.warmup < 2:
        ap.error("--paired needs --warmup 2 or more (the warm-up saves after its first step)")
    out: dict = {"machine": machine_info(), "loadavg_start": loadavg()}
    with tempfile.TemporaryDirectory(prefix="acc-bench-") as root:
        if not a.paired:
            out.update(separate_launches(a, root, variants, resumed))
        if a.paired or a.smoke:
            a.paired = True
            out["paired"] = paired_launches(a, root, paired)
    out["loadavg_after"] = loadavg()
    out["options"] = {k: getattr(a, k) for k in (*OPTIONS, "nproc", "writer", "repeats")}
    print(json.dumps(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
