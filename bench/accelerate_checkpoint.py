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

    python bench/accelerate_checkpoint.py                 # the BENCHMARKS.md configuration
    python bench/accelerate_checkpoint.py --smoke         # seconds: each code path once (one worker,
                                                          # a tiny model; the ratios are not figures)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, loadavg, machine_info, median, record_saves, table

VARIANTS = ("accelerate", "accelerate+save", "ours", "ours+save")
OPTIONS = ("steps", "warmup", "every", "hidden", "layers", "seq", "batch")  # passed to the workers


def worker(a: argparse.Namespace) -> None:
    """One rank of one variant (under its launcher): train, time every step, write the timings
    to ``timing-<rank>.json`` in ``--work`` (``--resume``: time ``load_state()`` instead)."""
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
    total = a.warmup + a.steps
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (a.batch * (total + 1), a.seq), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]
    loader = DataLoader(data, batch_size=a.batch // acc.num_processes, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, loader)
    rank = acc.process_index
    if a.resume:
        t0 = time.perf_counter()
        acc.load_state()
        out = {"resume_s": time.perf_counter() - t0}
    else:
        calls, ends, step = [], [], 0
        while step < total:
            for batch in loader:
                acc.backward(model(**batch).loss)
                opt.step()
                opt.zero_grad()
                step += 1
                if saving and step % a.every == 0:
                    c0 = time.perf_counter()
                    acc.save_state()
                    calls.append(time.perf_counter() - c0)
                ends.append(time.perf_counter())
                if step == total:
                    break
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


def launcher(variant: str, a: argparse.Namespace, work: Path) -> list[str]:
    """Accelerate's variants under torchrun (what ``accelerate launch --multi_cpu`` runs; a world of
    one: ``python script.py``); ours under the supervisor with the writer asked for."""
    common = ["--nproc-per-node", str(a.nproc), "--monitor-interval", "0.2"]
    if not variant.startswith("ours"):
        return [sys.executable, *(["-m", "torch.distributed.run", "--standalone", *common] if a.nproc > 1 else [])]
    sets = {
        "run.dir": work / "acc",
        "checkpoint.dir": work / "acc" / "checkpoints",
        "metrics.port": 0,
        "checkpoint.writer": a.writer,
        "checkpoint.keep_last": 2,
    }
    return [sys.executable, "-m", "elastic_trainer.cli", "run", *(f"--set={k}={v}" for k, v in sets.items()), *common]


def run(variant: str, a: argparse.Namespace, work: Path, resume: bool = False) -> list[dict]:
    args = [*launcher(variant, a, work), __file__, "--worker", "--variant", variant, "--work", str(work)]
    args += [f"--{k}={getattr(a, k)}" for k in OPTIONS] + (["--resume"] if resume else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{variant}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    ranks = [json.loads((work / f"timing-{i}.json").read_text()) for i in range(a.nproc)]
    for i in range(a.nproc):
        (work / f"timing-{i}.json").unlink()
    return ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=40, help="measured steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--every", type=int, default=10, help="save every N steps")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over the workers)")
    ap.add_argument("--nproc", type=int, default=2, help="workers (gloo, CPU)")
    ap.add_argument("--writer", choices=("thread", "process"), default="process", help="ours: checkpoint.writer")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--smoke", action="store_true", help="tiny and fast: the harness works")
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    variants, resumed = VARIANTS, ("accelerate+save", "ours+save")
    if a.smoke:  # each code path once: both integrations saving, our resume; one worker, a tiny model
        a.steps, a.warmup, a.every, a.hidden, a.layers, a.seq, a.batch = 4, 1, 2, 32, 1, 16, 2
        a.nproc, a.repeats, a.writer = 1, 1, "thread"
        variants, resumed = ("accelerate+save", "ours+save"), ("ours+save",)
    info = machine_info()
    res: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
    resume: dict[str, list[float]] = {v: [] for v in VARIANTS if v.endswith("+save")}
    with tempfile.TemporaryDirectory(prefix="acc-bench-") as root:
        for _ in range(a.repeats):
            for v in variants:
                work = Path(tempfile.mkdtemp(prefix=v.replace("+", "-") + "-", dir=root))
                res[v].append(run(v, a, work))
                if v in resumed:
                    resume[v].append(max(r["resume_s"] for r in run(v, a, work, resume=True)))
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
    out = {
        "machine": info,
        "loadavg_after": loadavg(),
        "options": {k: getattr(a, k) for k in (*OPTIONS, "nproc", "writer", "repeats")},
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
    print(json.dumps(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
