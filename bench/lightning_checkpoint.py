"""Lightning's own sharded checkpointing vs elastic_trainer's strategy, side by side in one run.

The same ``LightningModule`` (examples/lightning_fsdp2.py's causal LM, sized by ``--dim``/``--layers``),
the same ``Trainer`` settings, ``--nproc`` gloo workers (2) under ``torchrun`` on CPU, four
configurations run interleaved ``--repeats`` times:

* ``lightning``: ``ModelParallelStrategy`` (FSDP2), no saves;
* ``lightning+save``: the same, ``trainer.save_checkpoint`` every ``--every`` steps (what
  ``ModelCheckpoint(every_n_train_steps=...)`` calls: Lightning's synchronous sharded DCP save);
* ``ours``: ``elastic_trainer.lightning.Strategy`` with no save in the window;
* ``ours+save``: the same, ``checkpoint.interval_steps = --every`` (async, committed).

Reported: the training time blocked per save (Lightning: the ``save_checkpoint`` call; ours: the
save call plus the next step's wait for the staging copy, the slowest rank of each save) and the
wall time of the measured window (``--steps`` after ``--warmup``) with saves vs without, per
strategy. Ratios are what to read (the machine is shared).

    python bench/lightning_checkpoint.py                 # the BENCHMARKS.md configuration
    python bench/lightning_checkpoint.py --smoke         # seconds: each code path once (one worker,
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from bench.common import REPO, loadavg, machine_info, median, record_saves, table

MODES = ("lightning", "lightning+save", "ours", "ours+save")
RECOVERY = ("recover-lightning", "recover-ours")
LABELS = {"recover-lightning": 'torchrun + ckpt_path="last"', "recover-ours": "elastic-trainer run + Strategy"}
OPTIONS = ("steps", "warmup", "every", "dim", "layers", "vocab", "seq", "batch", "writer")  # passed to the workers


def kill_step(o: argparse.Namespace) -> int:
    """The recovery runs' victim step: half an interval after a save (the same steps lost by both)."""
    return 2 * o.every + o.every // 2


def worker(o: argparse.Namespace) -> None:
    """One rank of one configuration (under a launcher): train, time every step, write the timings.
    The recovery modes SIGKILL the last rank before step :func:`kill_step` of the first incarnation and
    record every step's end (rank 0) in ``timeline.jsonl``."""
    import signal

    import lightning.pytorch as L
    import lightning_fsdp2 as example
    from torch.utils.data import DataLoader

    recovery = o.worker in RECOVERY
    total = kill_step(o) + 5 if recovery else o.warmup + o.steps
    ours, saving = "ours" in o.worker, o.worker.endswith("+save")
    recorded = record_saves() if ours and saving else []  # ours: the manager's record per save
    work = Path(o.work)
    rank, restart = int(os.environ.get("RANK", "0")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    nproc = int(os.environ.get("WORLD_SIZE", "1"))

    class Clock(L.Callback):
        def __init__(self):
            self.ends: list[float] = []
            self.blocked: list[float] = []

        def on_train_batch_start(self, trainer, *args):
            if recovery and restart == 0 and rank == nproc - 1 and trainer.global_step + 1 == kill_step(o):
                (work / "killed").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer, *args):
            self.ends.append(time.perf_counter())
            step = trainer.global_step
            if recovery and rank == 0:
                with open(work / "timeline.jsonl", "a") as f:
                    f.write(json.dumps({"t": time.time(), "step": step, "restart": restart}) + "\n")
            if not ours and saving and step % o.every == 0 and step < total:
                t0 = time.perf_counter()
                trainer.save_checkpoint(work / f"lightning-step-{step}")
                self.blocked.append(time.perf_counter() - t0)

    callbacks: list = [Clock()]
    if o.worker == "recover-ours":  # under elastic-trainer run: the supervisor's config
        from elastic_trainer.lightning import Strategy

        strategy = Strategy()
    elif ours:
        from elastic_trainer.lightning import Strategy

        interval = o.every if saving else 10**9
        strategy = Strategy(
            overrides=[
                f"run.dir={work / 'run'}",
                f"checkpoint.dir={work / 'ckpt'}",
                f"checkpoint.interval_steps={interval}",
                f"train.global_batch_size={o.batch}",
                f"checkpoint.writer={o.writer}",
            ]
        )
    else:
        from lightning.pytorch.callbacks import ModelCheckpoint
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=nproc, tensor_parallel_size=1)
        if recovery:  # Lightning's own fault tolerance: a last checkpoint every N steps, fit(ckpt_path="last")
            callbacks.append(
                ModelCheckpoint(
                    dirpath=work / "lightning-ckpts", every_n_train_steps=o.every, save_top_k=0, save_last=True
                )
            )
    clock = callbacks[0]
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=nproc,
        strategy=strategy,
        max_steps=total,
        callbacks=callbacks,
        enable_checkpointing=len(callbacks) > 1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = example.CausalLM(
        vocab=o.vocab, dim=o.dim, layers=o.layers, heads=4, seq_len=o.seq, dropout=0.0, steps=total
    )
    data = example.Tokens(o.batch * (total + 1), o.seq + 1, o.vocab)
    loader = DataLoader(data, batch_size=o.batch // nproc)
    trainer.fit(model, loader, ckpt_path="last" if o.worker == "recover-lightning" else None)
    if recovery:
        return
    if ours and saving:
        clock.blocked = [s.stall for s in recorded if s.step < total]  # per save: call + staging wait
    window = clock.ends[o.warmup - 1 : total]  # from the end of the warm-up to the end of step total
    out = {"wall": window[-1] - window[0], "blocked": clock.blocked, "steps": len(window) - 1}
    (work / f"timing-{rank}.json").write_text(json.dumps(out))
    if ours:
        strategy.session.close()


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def launch(mode: str, o: argparse.Namespace, root: Path, launcher: list[str], tries: int = 1) -> Path:
    """Run ``mode``'s workers under ``launcher`` to the end (up to ``tries`` times: a failed try is
    counted in ``work/failed``); returns their work directory."""
    work = Path(tempfile.mkdtemp(prefix=mode.replace("+", "-") + "-", dir=root))
    args = [*launcher, __file__, "--worker", mode, "--work", str(work), *(f"--{k}={getattr(o, k)}" for k in OPTIONS)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for attempt in range(tries):
        r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
        if r.returncode == 0:
            (work / "failed").write_text(str(attempt))
            return work
        print(f"{mode} failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        for leftover in work.iterdir():
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    raise SystemExit(f"{mode} failed {tries} times:\n{r.stderr[-3000:]}")


def run_mode(mode: str, o: argparse.Namespace, root: Path) -> dict:
    work = launch(mode, o, root, [*TORCHRUN, "--nproc-per-node", str(o.nproc)])
    ranks = [json.loads((work / f"timing-{i}.json").read_text()) for i in range(o.nproc)]
    blocked = [max(x) for x in zip(*(rk["blocked"] for rk in ranks), strict=True)]  # the slowest rank per save
    return {"wall": max(rk["wall"] for rk in ranks), "blocked": blocked}


def run_recovery(mode: str, o: argparse.Namespace, root: Path) -> dict:
    """SIGKILL the last rank mid-run; seconds from the kill to the first step after the restart and to
    the end of the killed step, redone. Lightning: ``torchrun --max-restarts 1`` and
    ``fit(ckpt_path="last")``; ours: ``elastic-trainer run --max-restarts 1`` with the strategy."""
    common = ["--nproc-per-node", str(o.nproc), "--max-restarts", "1", "--monitor-interval", "0.2"]
    if mode == "recover-lightning":
        launcher = [*TORCHRUN, *common]
    else:
        work = Path(tempfile.mkdtemp(prefix="ours-dirs-", dir=root))
        sets = {
            "run.dir": work / "run",
            "checkpoint.dir": work / "ckpt",
            "metrics.port": 0,
            "checkpoint.interval_steps": o.every,
            "train.global_batch_size": o.batch,
            "checkpoint.writer": o.writer,
        }
        launcher = [sys.executable, "-m", "elastic_trainer.cli", "run", *(f"--set={k}={v}" for k, v in sets.items())]
        # a user's script imports lightning at its top, which the zygote preloads; this one imports it in worker()
        launcher += [*common, "--preload", "lightning.pytorch"]
    work = launch(mode, o, root, launcher, tries=3)
    killed = float((work / "killed").read_text())
    after = [json.loads(line) for line in (work / "timeline.jsonl").read_text().splitlines()]
    after = [x for x in after if x["restart"] == 1]
    redone = next(x for x in after if x["step"] == kill_step(o))
    return {
        "first_step": after[0]["t"] - killed,
        "killed_step_redone": redone["t"] - killed,
        "resumed_from": after[0]["step"] - 1,
        "failed_tries": int((work / "failed").read_text()),
    }


def throughput_report(results: dict[str, list[dict]], o: argparse.Namespace) -> dict:
    wall = {m: median(r["wall"] for r in results[m]) for m in MODES}
    blocked = {m: median(b for r in results[m] for b in r["blocked"]) for m in ("lightning+save", "ours+save")}
    ratio = {"lightning": wall["lightning"] / wall["lightning+save"], "ours": wall["ours"] / wall["ours+save"]}
    header = ["strategy", "blocked per save (s)", "window, no saves (s)", f"window, save every {o.every} (s)", "ratio"]
    rows = [
        [n, f"{blocked[n + '+save']:.3f}", f"{wall[n]:.2f}", f"{wall[n + '+save']:.2f}", f"{ratio[n]:.3f}"]
        for n in ("lightning", "ours")
    ]
    print(table(header, rows))
    print(f"blocked per save, ours / Lightning's: {blocked['ours+save'] / blocked['lightning+save']:.3f}")
    return {
        "wall_seconds": wall,
        "blocked_per_save_seconds": blocked,
        "blocked_ratio_ours_over_lightning": blocked["ours+save"] / blocked["lightning+save"],
        "throughput_with_saves_over_none": ratio,
    }


def recovery_report(recovered: dict[str, list[dict]]) -> dict:
    redone = {m: median(r["killed_step_redone"] for r in recovered[m]) for m in RECOVERY}
    header = ["after a SIGKILLed worker", "to the first step (s)", "to the killed step, redone (s)", "resumed from"]
    rows = [
        [
            LABELS[m],
            f"{median(r['first_step'] for r in recovered[m]):.2f}",
            f"{redone[m]:.2f}",
            ", ".join(str(r["resumed_from"]) for r in recovered[m]),
        ]
        for m in RECOVERY
    ]
    print(table(header, rows))
    ratio = redone["recover-ours"] / redone["recover-lightning"]
    failed = sum(r["failed_tries"] for r in recovered["recover-lightning"])
    print(f"recovery (the killed step redone), ours / Lightning's: {ratio:.3f}; torchrun tries that failed: {failed}")
    return {"recovery_seconds": recovered, "recovery_ratio_ours_over_lightning": ratio}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=MODES + RECOVERY, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps: seconds")
    p.add_argument("--steps", type=int, default=40, help="measured steps after the warm-up")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (split over the workers)")
    p.add_argument("--nproc", type=int, default=2, help="workers (gloo, CPU)")
    p.add_argument("--writer", choices=("thread", "process"), default="process", help="ours: checkpoint.writer")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", choices=("throughput", "recovery"), help="run one half of the comparison")
    p.add_argument("--json", help="write the results here too")
    o = p.parse_args()
    if o.worker:
        worker(o)
        return 0
    modes, recovery = MODES, RECOVERY
    if o.smoke:  # each code path once: both strategies saving, our recovery; one worker, a tiny model
        o.steps, o.warmup, o.every, o.dim, o.layers, o.vocab, o.seq = 4, 1, 2, 32, 1, 64, 16
        o.nproc, o.repeats, o.writer = 1, 1, "thread"  # no writer processes to start
        modes, recovery = ("lightning+save", "ours+save"), ("recover-ours",)
    info = machine_info()
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    recovered: dict[str, list[dict]] = {m: [] for m in RECOVERY}
    with tempfile.TemporaryDirectory(prefix="lightning-bench-") as root:
        for _ in range(o.repeats):
            for mode in modes if o.only != "recovery" else ():
                results[mode].append(run_mode(mode, o, Path(root)))
            for mode in recovery if o.only != "throughput" else ():
                recovered[mode].append(run_recovery(mode, o, Path(root)))
    out: dict = {"machine": info, "loadavg_after": loadavg(), "options": {k: getattr(o, k) for k in OPTIONS}}
    out["repeats"] = o.repeats
    if o.only != "recovery":
        out.update(throughput_report(results, o))
    if o.only != "throughput":
        out.update(recovery_report(recovered))
    if o.json:
        Path(o.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
