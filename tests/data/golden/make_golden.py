"""Writes the golden checkpoints under tests/data/golden/ (run once, with the elastic_trainer
version whose format they pin; tests/e2e/test_golden.py loads them with every later version).

    python tests/data/golden/make_golden.py

* ``demo/``: the built-in trainer (tiny demo model, 2 workers) committed at step 5 of a 10-step
  run; ``demo/losses.json`` holds that uninterrupted run's loss per step.
* ``example/``: example_script.py (examples/train_fsdp.py as it was then: its sampler, LambdaLR
  scheduler, per-rank RNG with dropout; 2 workers) committed at step 5 of 12; ``example/losses.json`` likewise.

The demo's data view records absolute paths (by design: a resume reads exactly the files of
the first start), so its token file lives at :data:`DEMO_DATA`, rebuilt from ``demo-tokens.bin``
by the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests import runs

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DEMO_DATA = "/tmp/elastic-trainer-golden/demo-tokens.bin"
DEMO_TRAIN = {"micro_batch_size": 2}  # the tiny config's when the demo checkpoint was recorded


def _keep_step5(ckpt: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(ckpt / "step-00000005", out / "ckpt" / "step-00000005")


def demo(tmp: Path) -> None:
    from elastic_trainer.worker.tokens import build_token_file

    os.makedirs(os.path.dirname(DEMO_DATA), exist_ok=True)
    text = tmp / "text.txt"
    text.write_bytes((REPO / "elastic_trainer" / "checkpoint" / "manager.py").read_bytes()[:40000])
    build_token_file([str(text)], DEMO_DATA)
    shutil.copy(DEMO_DATA, HERE / "demo-tokens.bin")
    run = tmp / "demo"
    cfg = runs.write_config(tmp / "demo.toml", DEMO_DATA, run, train=DEMO_TRAIN, checkpoint={"keep_last": 5})
    r = runs.run_launch(cfg)
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-3000:]
    _keep_step5(run / "ckpt", HERE / "demo")
    (HERE / "demo" / "losses.json").write_text(json.dumps(runs.step_losses(run)))


def example(tmp: Path) -> None:
    run, ckpt = tmp / "example", tmp / "example-ckpt"
    run.mkdir()
    args = [
        *runs.CLI,
        "run",
        "--set",
        f"run.dir={run}",
        "--set",
        f"checkpoint.dir={ckpt}",
        "--set",
        "metrics.port=0",
        "--nproc-per-node",
        "2",
        str(HERE / "example_script.py"),
        "--run-dir",
        str(run),
        "--ckpt",
        str(ckpt),
        "--steps",
        "12",
    ]
    r = subprocess.run(args, env=runs.env_for_tests(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _keep_step5(ckpt, HERE / "example")
    (HERE / "example" / "losses.json").write_text(json.dumps(runs.step_losses(run)))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        demo(Path(d))
        example(Path(d))
    print("golden checkpoints written under", HERE)
