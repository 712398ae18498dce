"""One command that proves the GPU paths: NCCL, bf16, CUDA RNG, pinned staging, the hang watchdog.

    python bench/gpu_check.py [--device cuda|cpu] [--out DIR] [--budget-seconds 480]

On a machine with NVIDIA GPUs (``--device cuda``, the default when one is visible) every step runs
on all visible GPUs with NCCL (world = number of GPUs); ``--device cpu`` is the same script at
reduced sizes on 2 gloo ranks (the dry run CI keeps green). No network is needed. Each step runs
in its own processes under its own time bound; a failing step is reported and the others still
run. Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` and exits 1 if a step failed.

Steps:

* ``demo`` — the demo model (``elastic-trainer launch``) with bf16 mixed precision on CUDA, a save
  every few steps: steps, tokens/s, commits;
* ``resume_bitwise`` — the same run with dropout, the last rank SIGKILLed mid-run once a save has
  committed, resumed by the supervisor: every step's loss bitwise that of an uninterrupted run
  (CUDA RNG restored); with 2+ ranks the survivors' collectives must not hang past the bound;
* ``hang_watchdog`` — a rank SIGSTOPped mid-run (with 2+ ranks the others stall in a collective):
  the watchdog restarts the group within ``elastic.hang_timeout_seconds`` (+ slack);
* ``reshard`` (2+ ranks) — a checkpoint saved at world N resumed at world 1: the next step's loss
  within 1e-5 (relative) of the uninterrupted world-N run;
* ``checkpoint_stall`` — ``bench/checkpoint_stall.py`` at >= 1 GiB of state per rank on CUDA:
  training blocked per save and the overlapped step's extra time vs synchronous ``dcp.save``,
  thread vs process writer (and torchtitan's manager when importable);
* ``own_loop`` and ``port_*`` — ``examples/train_fsdp.py`` and both ports under ``elastic-trainer run``;
* ``lightning`` / ``accelerate`` — the framework integrations' examples (``examples/lightning_fsdp2.py``,
  ``examples/accelerate_clm.py``, on CUDA with Accelerate's FSDP2 plugin, ``--fsdp2-plugin``) under
  ``run`` on the device; skipped when the framework is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, machine_info, table
from elastic_trainer.config import PROCESS_WRITER_MIN_TORCH, torch_release
from tests import runs


class Skip(Exception):
    """A step that does not apply here (reported as skipped, not failed)."""


def _sizes(device: str, world: int) -> dict:
    if device == "cuda":
        # 12 bytes/parameter (fp32 + AdamW moments); the demo GPT's ~12 dim^2 parameters per layer:
        # dim 1024 x 8 layers per rank ~ 100M parameters, ~1.2 GiB of state per rank.
        stall = ["--dim", "1024", "--layers", str(8 * world), "--heads", "16", "--rounds", "2", "--every", "10"]
        return {"steps": 40, "every": 10, "stall": stall}
    return {
        "steps": 8,
        "every": 3,
        "stall": ["--dim", "64", "--layers", "2", "--heads", "2", "--rounds", "1", "--every", "3", "--skip-sync"],
    }


class Check:
    def __init__(self, device: str, world: int, work: Path, data: str, deadline: float):
        self.device, self.world, self.work, self.data, self.deadline = device, world, work, data, deadline
        self.size = _sizes(device, world)
        self.train = {"device": device, "mixed_precision": "bf16" if device == "cuda" else "fp32"}

    def _timeout(self, want: float) -> float:
        left = self.deadline - time.monotonic()
        if left < 10:
            raise TimeoutError("the check's time budget is spent")
        return min(want, left)

    def launch(
        self, name: str, env: dict | None = None, nproc: int | None = None, check: bool = True, **sections
    ) -> tuple[Path, float]:
        run_dir = self.work / name
        sections.setdefault("train", {})
        sections["train"] = {**self.train, "steps": self.size["steps"], **sections["train"]}
        sections.setdefault("checkpoint", {}).setdefault("interval_steps", self.size["every"])
        sections.setdefault("elastic", {}).setdefault("max_restarts", 1)
        cfg = runs.write_config(self.work / f"{name}.toml", self.data, run_dir, **sections)
        t0 = time.monotonic()
        r = runs.run_launch(cfg, "--nproc-per-node", str(nproc or self.world), env=env, timeout=self._timeout(150))
        wall = time.monotonic() - t0
        if check and r.returncode != 0:
            raise RuntimeError(f"launch exit {r.returncode}: {cfg.with_suffix('.log').read_text()[-2000:]}")
        return run_dir, wall

    def losses(self, run_dir: Path) -> list[float]:
        got = runs.step_losses(run_dir)
        return [got[s] for s in sorted(got)]

    # ------------------------------------------------------------------ steps
    def demo(self) -> dict:
        run_dir, wall = self.launch("demo")
        steps = len(runs.step_losses(run_dir))
        commits = runs.read_events(run_dir, "checkpoint_committed")
        if steps != self.size["steps"] or not commits:
            raise RuntimeError(f"{steps} steps, {len(commits)} commits")
        times = [e["time"] for e in runs.read_events(run_dir, "step")]
        tokens = (len(times) - 1) * runs.TINY["train"]["global_batch_size"] * runs.TINY["model"]["seq_len"]
        rate = tokens / (times[-1] - times[0]) if len(times) > 1 else float("nan")
        return {"steps": steps, "commits": len(commits), "wall_s": round(wall, 1), "tokens_per_s": round(rate)}

    def resume_bitwise(self) -> dict:
        every, last = self.size["every"], self.world - 1
        model = {"dropout": 0.1}
        ref, _ = self.launch("ref", model=model)
        kill = f"kill@rank={last},step={every * 2},committed={every}"
        killed, wall = self.launch("killed", env={"ELASTIC_TRAINER_INJECT_FAULT": kill}, model=model)
        resumes = runs.read_events(killed, "resume")
        restarts = runs.read_events(killed, "restart")
        a, b = self.losses(ref), self.losses(killed)
        if [e["step"] for e in resumes] != [every] or a != b:
            # which steps differ, and whether already before the kill (the device's kernels not
            # reproducible run to run) or only after the resume (what the resume restored)
            differ = [i + 1 for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
            raise RuntimeError(
                f"resumes {[e['step'] for e in resumes]} (want [{every}]); {len(a)} vs {len(b)} steps; "
                f"steps whose losses differ: {differ[:10]}; before the kill at {every * 2}: "
                f"{[i for i in differ if i < every * 2]}"
            )
        return {
            "fault": kill,
            "resumed_from": every,
            "restarts": len(restarts),
            "bitwise": True,
            "wall_s": round(wall, 1),
        }

    def hang_watchdog(self) -> dict:
        bound = 20
        every = self.size["every"]
        hang = f"hang@rank={self.world - 1},step={every * 2},committed={every}"
        run_dir, wall = self.launch(
            "hang",
            env={"ELASTIC_TRAINER_INJECT_FAULT": hang},
            elastic={"hang_timeout_seconds": bound, "max_restarts": 1},
        )
        restarts = runs.read_events(run_dir, "restart")
        finished = runs.read_events(run_dir, "finished")
        if len(restarts) != 1 or not finished:
            raise RuntimeError(f"restarts {restarts}, finished {finished}")
        # the last step event before the restart is when the rank stopped
        steps = [e for e in runs.read_events(run_dir) if e["event"] == "step" and e["time"] < restarts[0]["time"]]
        detect = restarts[0]["time"] - steps[-1]["time"] if steps else float("nan")
        if not detect <= bound + 10:
            raise RuntimeError(f"hang caught after {detect:.1f}s (bound {bound}s)")
        return {"fault": hang, "hang_timeout_s": bound, "caught_after_s": round(detect, 1), "wall_s": round(wall, 1)}

    def reshard(self) -> dict:
        if self.world < 2:
            raise Skip("needs >= 2 ranks")
        every = self.size["every"]
        # world N saves at `every` and dies at the next step (no restart); world 1 resumes that save
        if not (self.work / "demo").exists():
            self.demo()
        ckpt = str(self.work / "reshard-ckpt")
        stop = {"ELASTIC_TRAINER_INJECT_FAULT": f"kill@rank=0,step={every + 1},committed={every}"}
        self.launch("reshard-n", env=stop, check=False, checkpoint={"dir": ckpt}, elastic={"max_restarts": 0})
        one, _ = self.launch("reshard-1", nproc=1, checkpoint={"dir": ckpt})
        (resume,) = runs.read_events(one, "resume")
        ref = runs.step_losses(self.work / "demo")  # the uninterrupted world-N run, same config
        got = runs.step_losses(one)
        diff = max(abs(ref[s] - got[s]) / abs(ref[s]) for s in got if s > resume["step"])
        if resume["step"] != every or not diff <= 1e-5:
            raise RuntimeError(f"resumed at {resume['step']} (want {every}); largest relative loss difference {diff}")
        return {"from_world": self.world, "resumed_step": resume["step"], "max_loss_rel_diff": diff}

    def checkpoint_stall(self) -> dict:
        # the writer process where this torch has it; on CUDA also staging without pinned memory
        process = ["process"] if torch_release() >= PROCESS_WRITER_MIN_TORCH else []
        modes = ",".join(["thread", *(["thread-pageable"] if self.device == "cuda" else []), *process])
        out = self.work / "stall.json"
        args = [sys.executable, str(REPO / "bench" / "checkpoint_stall.py"), "--world", str(self.world)]
        args += ["--device", self.device]
        args += [*self.size["stall"], "--modes", modes, "--data", self.data, "--json-out", str(out)]
        if importlib.util.find_spec("torchtitan") is not None:
            args += ["--peer", "torchtitan"]
        env = runs.env_for_tests()
        r = subprocess.run(args, capture_output=True, text=True, timeout=self._timeout(300), env=env, cwd=REPO)
        if r.returncode != 0:
            raise RuntimeError(f"checkpoint_stall exit {r.returncode}: {r.stderr[-2000:]}")
        summary = json.loads(out.read_text())["summary"]
        return {k: summary[k] for k in ("median", "ratios", "model") if k in summary}

    def _run_script(self, name: str, script: str, *script_args: str) -> dict:
        run_dir = self.work / name
        run_dir.mkdir(parents=True, exist_ok=True)
        args = runs.run_args(run_dir, self.work / "ckpt" / name, str(REPO / "examples" / script), nproc=self.world)
        args[args.index("run") + 1 : args.index("run") + 1] = ["--set", f"train.device={self.device}"]
        t0 = time.monotonic()
        with open(run_dir / "run.log", "ab") as log:
            r = subprocess.run(
                [*args, *script_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=runs.env_for_tests({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}),
                cwd=REPO,
                timeout=self._timeout(150),
            )
        if r.returncode != 0:
            raise RuntimeError(f"exit {r.returncode}: {(run_dir / 'run.log').read_text()[-2000:]}")
        commits = runs.read_events(run_dir, "checkpoint_committed")
        # forked from the zygote (False: its imports initialised CUDA or a process group, and the
        # workers started cold: slower restarts, reported rather than failed)
        warm = all(e.get("warm") for e in runs.read_events(run_dir, "workers_started"))
        return {"wall_s": round(time.monotonic() - t0, 1), "commits": len(commits), "warm": warm}

    def own_loop(self) -> dict:
        return self._run_script("own_loop", "train_fsdp.py", "--steps", "10")

    def port_fsdp2_transformer(self) -> dict:
        extra = ["--mixed-precision"] if self.device == "cuda" else []
        return self._run_script("port_fsdp2", "fsdp2_transformer.py", "--steps", "10", *extra)

    def port_hf_causal_lm(self) -> dict:
        if importlib.util.find_spec("transformers") is None:
            raise Skip("not installed: transformers")
        return self._run_script("port_hf", "hf_causal_lm.py", "--steps", "10")

    def lightning(self) -> dict:
        if importlib.util.find_spec("lightning") is None:
            raise Skip("not installed: lightning")
        return self._run_script("lightning", "lightning_fsdp2.py", "--steps", "10", "--devices", str(self.world))

    def accelerate(self) -> dict:
        if importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("transformers") is None:
            raise Skip("not installed: accelerate or transformers")
        if self.device != "cuda":
            return self._run_script("accelerate", "accelerate_clm.py", "--steps", "10")
        # on GPUs through Accelerate's own FSDP2 plugin: Accelerate shards the model
        out = self._run_script("accelerate", "accelerate_clm.py", "--steps", "10", "--fsdp2-plugin")
        log = (self.work / "accelerate" / "run.log").read_text()
        if '"fsdp2_sharded": true' not in log:
            raise RuntimeError(f"Accelerate's FSDP2 plugin did not shard the model: {log[-2000:]}")
        return {**out, "fsdp2_plugin": True}


STEPS = (
    "demo",
    "resume_bitwise",
    "hang_watchdog",
    "reshard",
    "checkpoint_stall",
    "own_loop",
    "port_fsdp2_transformer",
    "port_hf_causal_lm",
    "lightning",
    "accelerate",
)


def run_check(device: str, out: Path, budget: float, only: list[str] | None = None) -> dict:
    import torch

    world = torch.cuda.device_count() if device == "cuda" else 2
    if world < 1:
        raise SystemExit("gpu_check: --device cuda but no CUDA device is visible")
    info = machine_info()
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(world)]
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    t_start = time.monotonic()
    report = {"device": device, "world": world, "info": info, "steps": []}
    try:
        data = str(work / "tokens.bin")
        from elastic_trainer.worker.tokens import build_token_file, default_demo_texts

        build_token_file(default_demo_texts(1 << 20), data)
        check = Check(device, world, work, data, t_start + budget)
        for name in only or STEPS:
            t0 = time.monotonic()
            row = {"step": name}
            try:
                row["result"] = getattr(check, name)()
                row["status"] = "passed"
            except Skip as e:
                row["status"], row["reason"] = "skipped", str(e)
            except Exception as e:  # noqa: BLE001 - every step's failure is reported and the rest still run
                row["status"], row["error"] = "failed", f"{type(e).__name__}: {e}"
                row["traceback"] = traceback.format_exc()[-3000:]
            row["seconds"] = round(time.monotonic() - t0, 1)
            report["steps"].append(row)
            report["wall_seconds"] = round(time.monotonic() - t_start, 1)
            _write(report, out)  # after every step: a check stopped from outside still leaves its report
            print(f"gpu_check: {name}: {row['status']} ({row['seconds']} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["wall_seconds"] = round(time.monotonic() - t_start, 1)
    _write(report, out)
    return report


def _write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    info = report["info"]
    where = ", ".join(info.get("gpus", [])) or f"CPU ({info['cpu']})"
    rows = []
    for r in report["steps"]:
        detail = r.get("reason") or r.get("error", "").splitlines()[0][:200] if r["status"] != "passed" else ""
        if r["status"] == "passed":
            detail = json.dumps(r["result"], default=str)[:300]
        rows.append([r["step"], r["status"], r["seconds"], detail])
    head = (
        f"# GPU check: {report['device']}, world {report['world']}\n\n"
        f"Measured on {where}; torch {info['torch']}{', NCCL ' + info['nccl'] if 'nccl' in info else ''}; "
        f"{info['date_utc']} UTC; {report['wall_seconds']} s in all.\n\n"
    )
    return head + table(["step", "status", "seconds", "result"], rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when a GPU is visible")
    ap.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--budget-seconds", type=float, default=480, help="bound on the whole check (default 8 min)")
    ap.add_argument("--steps", default="", help=f"comma-separated subset of: {', '.join(STEPS)}")
    a = ap.parse_args()
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    only = [s for s in a.steps.split(",") if s]
    unknown = sorted(set(only) - set(STEPS))
    if unknown:
        ap.error(f"unknown steps {unknown}; known: {', '.join(STEPS)}")
    report = run_check(device, Path(a.out), a.budget_seconds, only or None)
    print((Path(a.out) / "gpu_check.md").read_text())
    return 1 if any(r["status"] == "failed" for r in report["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
