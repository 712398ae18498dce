"""The Hugging Face Transformers ``Trainer`` with its own checkpointing, side by side with
elastic_trainer's (``from elastic_trainer.transformers import Trainer``), on
``examples/transformers_clm.py`` in one invocation.

Both variants run the example script itself: ``ours`` is the example as it is; ``plain`` is the
same file with its one elastic_trainer line, ``from elastic_trainer.transformers import Trainer``,
replaced by ``from transformers import Trainer`` (written to a temporary folder: the benchmark
measures exactly the one-line diff). Same ``TrainingArguments`` (the example's: ``save_steps``,
``save_total_limit=2``, a cosine schedule with warm-up, gradient accumulation 2, dropout), same
GPT-2 from a config, same corpus, ``--nproc`` gloo ranks on CPU (``OMP_NUM_THREADS=1``). The
plain variant runs under ``torchrun``, ours under ``elastic-trainer run``, both with
``--standalone --monitor-interval 0.1``. Ours' zygote preloads the example's top-level imports
and the names it takes from them (``--preload``), as ``run`` of the example itself would: the
script ``run`` starts here is this wrapper, whose own imports are not the example's.

Each worker runs the example through this file (``--wrap``), which only measures: a
``TrainerCallback`` added in ``Trainer.__init__`` logs the wall time of every optimizer step's
end (``on_step_end``) per rank, the Trainer's ``_save_checkpoint`` is timed, and (ours) the
checkpoint manager's record of each save is kept (``bench/common.record_saves``). The no-save
variants set ``save_strategy="no"`` on the example's ``TrainingArguments`` (nothing else
changes). Measured, per round, the launches alternated (the order reversed every other round):

1. **Training blocked per save** (the slowest rank of each save, median over the saves of a
   launch): plain, the wall time of ``Trainer._save_checkpoint`` (synchronous: model, optimizer,
   scheduler, RNG and ``trainer_state.json`` into ``checkpoint-N``, and the rotation
   ``save_total_limit`` asks for); ours, the time the training thread was blocked by the save
   as the checkpoint manager records it (the wait for a previous save still writing + the save
   call + the next optimizer step's wait for the staging copy). Also, the same way for both:
   the extra wall time of the step interval that holds a save (``on_step_end`` of the saving
   step to ``on_step_end`` of the next) over the median interval without one — for ours this
   also holds what the background write takes from that step on shared cores.
2. **Throughput**: the wall time of ``--steps`` steps after ``--warmup`` steps (rank 0's
   ``on_step_end`` times), a save every ``--every`` steps vs ``save_strategy="no"``, per
   variant (``no saves ÷ saves`` of the same round: paired); also ours ÷ plain without saves.
3. **Recovery after a SIGKILLed worker**: ``--max-restarts 1``; the example's own resume
   (``get_last_checkpoint(output_dir)`` → ``resume_from_checkpoint``, as run_clm does) under
   ``torchrun``; ours under ``elastic-trainer run`` (a warm restart, the newest valid commit).
   The example runs with a save every ``--every`` steps (and enough steps to outlast the
   measurement: it ends by itself ``max(40, 4 × --every)`` steps after the kill); once rank 0 has
   finished step 1.5 × ``--every`` (the middle of a save cycle) the newest worker process is
   SIGKILLed from outside. Recovery = the kill → the first step completed by the restarted
   workers (rank 0's ``on_step_end``); recomputed = the steps done before the kill that were
   done again. Where the launcher's restart fails and the job ends (plain torchrun's restarted
   group can fail to connect: its gloo rendezvous reads the killed group's addresses), the same
   command is relaunched at once, as a scheduler's retry would, and the recovery runs to the
   relaunched job's first step (counted in the table); a launch that hangs is retried (up to 3
   tries) and counted, not measured.

Ratios are paired per round (ours ÷ plain of the same round; each variant's saves ÷ no saves of
the same round), medians over the rounds.

    python bench/transformers_trainer.py                  # the BENCHMARKS.md configuration (~7-10 min here)
    python bench/transformers_trainer.py --n-embd 384 --n-layer 6    # a small GPT-2: 10.8M parameters
    python bench/transformers_trainer.py --writer process            # ours with checkpoint.writer = "process"
    python bench/transformers_trainer.py --direct-io false           # ours' shards through the page cache
    python bench/transformers_trainer.py --rounds 5 --json out.json
    python bench/transformers_trainer.py --smoke          # one short round of each, a few steps
                                                          # (~2 min here: six launches): the harness
                                                          # works, not a figure
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, loadavg, machine_info, median, table
from bench.run_recovery import descendants, training_processes
from elastic_trainer.supervisor.warm import script_imports

EXAMPLE = REPO / "examples" / "transformers_clm.py"
OURS_IMPORT = "from elastic_trainer.transformers import Trainer"
PLAIN_IMPORT = "from transformers import Trainer"
VARIANTS = ("plain", "ours")
TARGETS = {"blocked": 0.1, "throughput": 0.95, "recovery": 0.5}
PRCTL: list = [None]  # libc's prctl, looked up before any fork (lifeline.libc_prctl)


# --- inside each worker: the example, measured ------------------------------------------------


def wrap(argv: list[str]) -> None:
    """``--wrap VARIANT SAVES LOG_DIR EXAMPLE [example arguments]``: run EXAMPLE as ``__main__``
    with the measurements of the module docstring (``SAVES``: ``save`` or ``nosave``)."""
    variant, saves, log_dir, example, *rest = argv
    import transformers
    from transformers import TrainerCallback

    recorded = []
    if variant == "ours":
        from bench.common import record_saves

        recorded = record_saves()
    width = os.environ.get("BENCH_N_EMBD")
    if width:  # --n-embd: the example's GPT2Config at another width (both variants alike)
        config_init = transformers.GPT2Config.__init__

        def wider(self, *args, **kwargs):
            kwargs["n_embd"] = int(width)
            config_init(self, *args, **kwargs)

        transformers.GPT2Config.__init__ = wider
    if saves == "nosave":
        post_init = transformers.TrainingArguments.__post_init__

        def no_saves(self):
            self.save_strategy = "no"
            post_init(self)

        transformers.TrainingArguments.__post_init__ = no_saves

    class Timer(TrainerCallback):
        """Every optimizer step's end (wall clock), per rank, appended as it happens; the saves'
        timings at the end of training."""

        def __init__(self, trainer):
            self.trainer, self.calls = trainer, []
            self.rank = trainer.args.process_index
            self.log = open(os.path.join(log_dir, f"steps-rank{self.rank}.jsonl"), "a")

        def on_step_end(self, args, state, control, **kwargs):
            self.log.write(json.dumps({"step": state.global_step, "t": time.time(), "pid": os.getpid()}) + "\n")
            self.log.flush()

        def on_train_end(self, args, state, control, **kwargs):
            stalls = [  # ours: complete by now (the staging waits too)
                {"step": s.step, "s": s.stall, "parts": [s.wait_previous, s.call, s.staging_wait]} for s in recorded
            ]
            out = {"calls": self.calls, "stalls": stalls}
            Path(log_dir, f"saves-rank{self.rank}.json").write_text(json.dumps(out))

    init = transformers.Trainer.__init__

    def measured_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        timer = Timer(self)
        self.add_callback(timer)
        save = self._save_checkpoint

        def timed_save(model, trial):
            t0 = time.perf_counter()
            save(model, trial)
            timer.calls.append({"step": self.state.global_step, "s": time.perf_counter() - t0})

        self._save_checkpoint = timed_save

    transformers.Trainer.__init__ = measured_init
    sys.argv = [example, *rest]
    runpy.run_path(example, run_name="__main__")


# --- the launches --------------------------------------------------------------------------------


def plain_example(root: Path) -> Path:
    """The example with its elastic_trainer import replaced by Transformers' own (the only line)."""
    src = EXAMPLE.read_text()
    if src.count(OURS_IMPORT + "\n") != 1:
        raise SystemExit(f"{EXAMPLE}: expected the line {OURS_IMPORT!r} exactly once")
    path = root / "transformers_clm_plain.py"
    path.write_text(src.replace(OURS_IMPORT + "\n", PLAIN_IMPORT + "\n"))
    return path


def command(variant: str, saves: str, a, work: Path, example: Path, steps: int, restarts: int = 0) -> list[str]:
    opts = ["--standalone", "--nproc-per-node", str(a.nproc), "--max-restarts", str(restarts)]
    opts += ["--monitor-interval", "0.1"]
    script = [str(Path(__file__).resolve()), "--wrap", variant, saves, str(work / "log"), str(example)]
    script += ["--train-files", str(a.corpus), "--output-dir", str(work / "out"), "--steps", str(steps)]
    script += ["--save-steps", str(a.every), "--n-layer", str(a.n_layer)]
    if variant == "plain":
        return [sys.executable, "-m", "torch.distributed.run", *opts, *script]
    # run.dir and checkpoint.dir where the Trainer integration puts them by default (under output_dir;
    # `run` itself would default to runs/<script name>, shared by every launch)
    run_dir = work / "out" / "elastic_trainer"
    sets = [f"run.dir={run_dir}", f"checkpoint.dir={run_dir / 'checkpoints'}", "metrics.port=0"]
    sets += [f"checkpoint.writer={a.writer}", f"checkpoint.direct_io={a.direct_io}"]
    # the zygote imports what `run examples/transformers_clm.py` would have it import (the example's
    # top-level imports): the script `run` starts here is this wrapper, whose imports are not those
    preload = [f"--preload={m}" for m in script_imports(str(example))]
    sets_args = [f"--set={kv}" for kv in sets]
    return [sys.executable, "-m", "elastic_trainer.cli", "run", *sets_args, *preload, *opts, *script]


def die_with_us() -> None:
    """In a launcher we start (torchrun, the supervisor): SIGKILL when this process ends, however
    it ends (a killed benchmark leaves no training behind)."""
    from elastic_trainer import lifeline

    lifeline.prctl(lifeline.PR_SET_PDEATHSIG, signal.SIGKILL, PRCTL[0])


def env(a) -> dict:
    """The tests' environment (``OMP_NUM_THREADS=1``), and ``ACCELERATE_USE_CPU=true`` (what
    ``accelerate launch --cpu`` sets): without it the plain Trainer under torchrun on a machine
    without GPUs trains a world of one in every process (Accelerate's ``PartialState`` picks no
    distributed type for CPU unless asked). Ours runs the same with or without it."""
    from tests import runs

    return runs.env_for_tests({"ACCELERATE_USE_CPU": "true", "BENCH_N_EMBD": str(a.n_embd) if a.n_embd else None})


def read_steps(log: Path, rank: int = 0) -> list[dict]:
    path = log / f"steps-rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def training_run(variant: str, saves: str, a, root: Path, examples: dict) -> dict:
    """One launch to its end: rank 0's step times, every rank's saves."""
    work = Path(tempfile.mkdtemp(prefix=f"{variant}-{saves}-", dir=root))
    (work / "log").mkdir()
    total = a.warmup + a.steps
    r = subprocess.run(
        command(variant, saves, a, work, examples[variant], total),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env(a),
        timeout=600,
        preexec_fn=die_with_us,
    )
    if r.returncode != 0:
        raise SystemExit(f"{variant} {saves}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    ends = {rec["step"]: rec["t"] for rec in read_steps(work / "log")}
    ranks = [json.loads((work / "log" / f"saves-rank{i}.json").read_text()) for i in range(a.nproc)]
    shutil.rmtree(work, ignore_errors=True)
    in_window = range(a.warmup, total)  # saves of these steps happen inside the timed window

    def slowest(key: str) -> list[float]:  # per save, the slowest rank
        per_step: dict[int, float] = {}
        for rank in ranks:
            for rec in rank[key]:
                if rec["step"] in in_window:
                    per_step[rec["step"]] = max(per_step.get(rec["step"], 0.0), rec["s"])
        return [per_step[s] for s in sorted(per_step)]

    blocked = slowest("calls" if variant == "plain" else "stalls")
    saving = {s for s in in_window if s % a.every == 0} if saves == "save" else set()
    gaps = {s: ends[s] - ends[s - 1] for s in range(a.warmup + 1, total + 1)}
    plain_gaps = [g for s, g in gaps.items() if s - 1 not in saving]
    extra = [gaps[s + 1] - median(plain_gaps) for s in sorted(saving)]
    parts = [rec["parts"] for rank in ranks for rec in rank["stalls"] if rec["step"] in in_window]
    return {
        "variant": variant,
        "saves": saves,
        # ours: where the blocked time went, per rank and save (median): previous save, call, staging wait
        "blocked_parts_s": [median(p[i] for p in parts) for i in range(3)] if parts else None,
        "window_s": ends[total] - ends[a.warmup],
        "median_step_s": median(plain_gaps),
        "blocked_s": blocked,
        "interval_extra_s": extra,
    }


def workers(launcher: int) -> list[int]:
    """The training processes under ``launcher`` (this file running the example), not their
    DataLoader workers, nor torchrun's agent or our supervisor."""
    return training_processes(launcher, b"--wrap")


class NoRecovery(Exception):
    """A recovery run that did not get to its measurement (the launch ended or hung)."""


def wait(what: str, predicate, proc: subprocess.Popen, timeout: float, work: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        if proc.poll() is not None:
            break
        time.sleep(0.005)
    log = (work / "launch.log").read_text()[-4000:] if (work / "launch.log").exists() else ""
    why = f"exit {proc.returncode}" if proc.poll() is not None else "timeout"
    errors = [x for x in log.splitlines() if "Error" in x]
    why += f" ({errors[-1].strip()[:200]})" if errors else ""
    raise NoRecovery(f"waiting for {what}: {why}\n{log}")


def recovery_run(variant: str, a, root: Path, examples: dict) -> dict:
    """SIGKILL the newest worker once rank 0 has finished step 1.5 × every; the kill → the first
    step the restarted workers complete."""
    work = Path(tempfile.mkdtemp(prefix=f"{variant}-kill-", dir=root))
    (work / "log").mkdir()
    kill_after = a.every + max(a.every // 2, 1)
    steps = kill_after + max(40, 4 * a.every)  # ends by itself, well after the measurement

    def launch() -> subprocess.Popen:
        with open(work / "launch.log", "ab") as out:
            return subprocess.Popen(
                command(variant, "save", a, work, examples[variant], steps, restarts=1),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env(a),
                start_new_session=True,
                preexec_fn=die_with_us,
            )

    proc, relaunched, launched = launch(), "", []
    log = work / "log"
    try:
        wait("the kill point", lambda: any(r["step"] >= kill_after for r in read_steps(log)), proc, 300, work)
        pids = workers(proc.pid)
        if len(pids) != a.nproc:
            raise SystemExit(f"{variant}: found workers {pids}, expected {a.nproc}")
        killed = time.time()
        os.kill(pids[-1], signal.SIGKILL)

        def first_after():
            return next((r for r in read_steps(log) if r["t"] > killed and r["pid"] not in pids), None)

        try:
            after = wait("the first step after the restart", first_after, proc, 120, work)
        except NoRecovery as e:
            if proc.poll() is None:  # hung: not a failure a scheduler would see
                raise
            # the launcher's restart failed and the job ended: relaunched at once, the same command
            # (as a job scheduler's retry would), which resumes from what the job saved
            relaunched = str(e).splitlines()[0]
            print(f"{variant}: the restart failed, relaunched ({relaunched})", flush=True)
            launched.append(proc)
            proc = launch()
            after = wait("the first step after the relaunch", first_after, proc, 120, work)
        before = max(r["step"] for i in range(a.nproc) for r in read_steps(log, i) if r["t"] <= killed)
    finally:
        stragglers = descendants(proc.pid)
        for p in [proc.pid, *stragglers]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in [*launched, proc]:
            p.wait(60)
    shutil.rmtree(work, ignore_errors=True)
    return {
        "variant": variant,
        "recovery_s": after["t"] - killed,
        "last_step_before": before,
        "resumed_at": after["step"] - 1,
        "recomputed": before - (after["step"] - 1),
        "relaunched": relaunched,
    }


# --- the report ---------------------------------------------------------------------------------


def summarise(rounds: list[dict], a) -> tuple[str, dict]:
    def per_round(f) -> list[float]:
        return [f(r) for r in rounds]

    def med(xs: list[float]) -> float:
        return median(xs)

    def spread(xs: list[float], fmt: str) -> str:
        return f"{format(min(xs), fmt)}–{format(max(xs), fmt)}" if len(xs) > 1 else ""

    blocked = {v: per_round(lambda r, v=v: med(r[v, "save"]["blocked_s"])) for v in VARIANTS}
    extra = {v: per_round(lambda r, v=v: med(r[v, "save"]["interval_extra_s"])) for v in VARIANTS}
    thr = {v: per_round(lambda r, v=v: r[v, "nosave"]["window_s"] / r[v, "save"]["window_s"]) for v in VARIANTS}
    rec = {v: per_round(lambda r, v=v: r[v, "kill"]["recovery_s"]) for v in VARIANTS}
    redo = {v: per_round(lambda r, v=v: r[v, "kill"]["recomputed"]) for v in VARIANTS}
    step = {v: per_round(lambda r, v=v: r[v, "nosave"]["median_step_s"]) for v in VARIANTS}
    ratio = {
        "blocked": per_round(lambda r: med(r["ours", "save"]["blocked_s"]) / med(r["plain", "save"]["blocked_s"])),
        "extra": per_round(
            lambda r: med(r["ours", "save"]["interval_extra_s"]) / med(r["plain", "save"]["interval_extra_s"])
        ),
        "recovery": per_round(lambda r: r["ours", "kill"]["recovery_s"] / r["plain", "kill"]["recovery_s"]),
        "nosave": per_round(lambda r: r["plain", "nosave"]["window_s"] / r["ours", "nosave"]["window_s"]),
    }
    ms = ".1f"

    def cell(xs: list[float], fmt: str, scale: float = 1.0) -> str:
        xs = [x * scale for x in xs]
        s = spread(xs, fmt)
        return format(med(xs), fmt) + (f" ({s})" if s else "")

    def met(ok: bool) -> str:
        return "yes" if ok else "no"

    rows = [
        [
            "training blocked per save (ms)",
            cell(blocked["plain"], ms, 1e3),
            cell(blocked["ours"], ms, 1e3),
            f"**{cell(ratio['blocked'], '.3f')}**",
            f"≤ {TARGETS['blocked']} × plain: {met(med(ratio['blocked']) <= TARGETS['blocked'])}",
        ],
        [
            "extra time of the step interval holding a save (ms)",
            cell(extra["plain"], ms, 1e3),
            cell(extra["ours"], ms, 1e3),
            cell(ratio["extra"], ".3f"),
            "",
        ],
        [
            f"throughput, a save every {a.every} steps ÷ no saves",
            cell(thr["plain"], ".3f"),
            f"**{cell(thr['ours'], '.3f')}**",
            "",
            f"ours ≥ {TARGETS['throughput']}: {met(med(thr['ours']) >= TARGETS['throughput'])}",
        ],
        [
            "median step without saves (ms); ours ÷ plain in throughput",
            cell(step["plain"], ms, 1e3),
            cell(step["ours"], ms, 1e3),
            cell(ratio["nosave"], ".3f"),
            "",
        ],
        [
            "recovery after a SIGKILLed worker: kill → first step after the restart (s)",
            cell(rec["plain"], ".2f"),
            cell(rec["ours"], ".2f"),
            f"**{cell(ratio['recovery'], '.3f')}**",
            f"≤ {TARGETS['recovery']} × plain: {met(med(ratio['recovery']) <= TARGETS['recovery'])}",
        ],
        [
            "restarts that failed (the job ended; relaunched at once, included above)",
            f"{sum(bool(r['plain', 'kill']['relaunched']) for r in rounds)} of {len(rounds)}",
            f"{sum(bool(r['ours', 'kill']['relaunched']) for r in rounds)} of {len(rounds)}",
            "",
            "",
        ],
        [
            "tries that hung (retried, not counted)",
            str(sum(len(r["plain", "kill"]["failed_tries"]) for r in rounds)),
            str(sum(len(r["ours", "kill"]["failed_tries"]) for r in rounds)),
            "",
            "",
        ],
        [
            "steps recomputed after the kill",
            cell(redo["plain"], ".0f"),
            cell(redo["ours"], ".0f"),
            "",
            "",
        ],
    ]
    head = ["figure (median over rounds; min–max)", "Transformers `Trainer` (plain)", "elastic_trainer"]
    out = table([*head, "ours ÷ plain (paired)", "target"], rows)
    summary = {
        "blocked_ratio": med(ratio["blocked"]),
        "throughput_ours": med(thr["ours"]),
        "throughput_plain": med(thr["plain"]),
        "recovery_ratio": med(ratio["recovery"]),
        "per_round": {k: v for k, v in ratio.items()},
        "met": {
            "blocked": med(ratio["blocked"]) <= TARGETS["blocked"],
            "throughput": med(thr["ours"]) >= TARGETS["throughput"],
            "recovery": med(ratio["recovery"]) <= TARGETS["recovery"],
        },
    }
    return out, summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--wrap"]:
        wrap(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2, help="workers (gloo, CPU)")
    ap.add_argument("--every", type=int, default=10, help="save_steps")
    ap.add_argument("--warmup", type=int, default=10, help="steps before the timed window")
    ap.add_argument("--steps", type=int, default=50, help="steps in the timed window")
    ap.add_argument("--n-layer", type=int, default=2, help="the example's --n-layer")
    ap.add_argument("--n-embd", type=int, help="the GPT-2's width (default: the example's, 32)")
    ap.add_argument("--writer", choices=["thread", "process"], default="thread", help="ours: checkpoint.writer")
    ap.add_argument("--direct-io", choices=["true", "false"], default="true", help="ours: checkpoint.direct_io")
    ap.add_argument("--json", help="write every launch's figures here too")
    ap.add_argument("--smoke", action="store_true", help="one short round of each, a few steps: the harness works")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the launches' cleanup runs
    from elastic_trainer import lifeline

    PRCTL[0] = lifeline.libc_prctl()
    if a.smoke:
        a.rounds, a.every, a.warmup, a.steps = 1, 2, 2, 4
    info = machine_info()
    info["command"] = " ".join(["python bench/transformers_trainer.py", *argv])
    info["loadavg_start"] = loadavg()
    order = [("plain", "save"), ("ours", "save"), ("plain", "nosave"), ("ours", "nosave")]
    order += [("plain", "kill"), ("ours", "kill")]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tf-bench-") as tmp:
        root = Path(tmp)
        a.corpus = root / "corpus.txt"  # a fixed text nobody edits while this runs: ~3,600 blocks of 32 bytes
        shutil.copy(inspect.getsourcefile(inspect), a.corpus)
        examples = {"ours": EXAMPLE, "plain": plain_example(root)}
        for i in range(a.rounds):
            res = {}
            for v, kind in order if i % 2 == 0 else list(reversed(order)):
                t0 = time.monotonic()
                if kind == "kill":  # a launch that hangs is retried (up to 3 tries), and counted
                    failed = []
                    while True:
                        try:
                            r = recovery_run(v, a, root, examples)
                            break
                        except NoRecovery as e:
                            failed.append(str(e).splitlines()[0])
                            print(f"{v}: no recovery ({failed[-1]})", flush=True)
                            if len(failed) == 3:
                                raise SystemExit(f"{v}: no recovery in 3 tries\n{e}") from e
                    r["failed_tries"] = failed
                else:
                    r = training_run(v, kind, a, root, examples)
                r["launch_s"] = time.monotonic() - t0
                res[v, kind] = r
                print(json.dumps({"round": i + 1, **r}), flush=True)
            rounds.append(res)
    info["loadavg_end"] = loadavg()
    out, summary = summarise(rounds, a)
    print(
        f"\nmachine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}, {a.nproc} gloo ranks; "
        f"load {info['loadavg_start'][0]:.2f} → {info['loadavg_end'][0]:.2f}"
    )
    print(f"command: {info['command']}\n")
    print(out)
    print("\n" + json.dumps(summary))
    if a.json:
        launches = [{"round": i + 1, **r} for i, res in enumerate(rounds) for r in res.values()]
        Path(a.json).write_text(json.dumps({"info": info, "summary": summary, "launches": launches}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
