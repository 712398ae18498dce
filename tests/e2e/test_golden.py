"""Checkpoints outlive versions: golden checkpoints written by an earlier elastic_trainer
(tests/data/golden/, see make_golden.py there) load with this one and resume where they stood:
the losses after the resume are those of the uninterrupted run that wrote them. The example's
checkpoint is resumed by the script that wrote it (golden/example_script.py, the lower-level API).

The recorded losses are bit for bit those of the CPU kind that wrote them. Another kind (another
vector width: AVX2 against AVX-512, another vendor's BLAS path) rounds the same float32 sums
differently, by ~1e-7 relative per step, so the losses are compared within :data:`RTOL`: a
resume that lost anything (an optimizer moment, the scheduler's step, the data cursor, an RNG
state) moves them by 1e-4 relative or far more."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from tests import runs

GOLDEN = runs.REPO / "tests" / "data" / "golden"
DEMO_DATA = "/tmp/elastic-trainer-golden/demo-tokens.bin"  # the absolute path the demo's data view recorded
DEMO_TRAIN = {"micro_batch_size": 2}  # the tiny config's when the demo checkpoint was recorded
RTOL = 1e-5  # relative: float32 rounding of another CPU kind, over 5-7 steps (seen: ≤ 5e-7)


def _golden_losses(name: str) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((GOLDEN / name / "losses.json").read_text()).items()}


def _assert_resumed_losses(got: dict[int, float], ref: dict[int, float]) -> None:
    assert sorted(got) == sorted(ref), (got, ref)
    off = {s: abs(got[s] - ref[s]) / abs(ref[s]) for s in ref}
    assert max(off.values()) <= RTOL, f"relative difference per step {off}: {got} vs the recorded {ref}"


def test_golden_demo_checkpoint_resumes_with_the_recorded_losses(tmp_path):
    os.makedirs(os.path.dirname(DEMO_DATA), exist_ok=True)
    shutil.copy(GOLDEN / "demo-tokens.bin", DEMO_DATA)
    run = tmp_path / "demo"
    shutil.copytree(GOLDEN / "demo" / "ckpt", run / "ckpt")
    cfg = runs.write_config(tmp_path / "demo.toml", DEMO_DATA, run, train=DEMO_TRAIN, checkpoint={"keep_last": 5})
    r = runs.run_launch(cfg)
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]
    (resume,) = runs.read_events(run, "resume")
    assert resume["step"] == 5 and resume["rng"] == "restored"
    ref = _golden_losses("demo")
    _assert_resumed_losses(runs.step_losses(run), {s: ref[s] for s in range(6, 11)})


def test_golden_example_checkpoint_resumes_with_the_recorded_losses(tmp_path):
    run, ckpt = tmp_path / "example", tmp_path / "example-ckpt"
    run.mkdir()
    shutil.copytree(GOLDEN / "example" / "ckpt", ckpt)
    args = runs.run_args(
        run,
        ckpt,
        str(GOLDEN / "example_script.py"),
        "--run-dir",
        str(run),
        "--ckpt",
        str(ckpt),
        "--steps",
        "12",
    )
    r = subprocess.run(args, env=runs.env_for_tests(), cwd=runs.REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (resume,) = runs.read_events(run, "resume")
    assert resume["step"] == 5 and resume["rng"] == "restored"
    ref = _golden_losses("example")
    _assert_resumed_losses(runs.step_losses(run), {s: ref[s] for s in range(6, 13)})
