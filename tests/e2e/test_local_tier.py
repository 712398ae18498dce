"""The local tier through real ``elastic-trainer launch`` runs at world size 2 (issue #14 item 3).

``checkpoint.local_dir`` takes every save (interval 2); ``checkpoint.dir`` every 3rd and the final
one: saves at 2, 4 (local), 6 (both), 8, 10 (local), 12 (final, both). A worker SIGKILLed at the
start of step 11 resumes from the local copy of step 10 or 8 (newer than the remote 6), bitwise on the
losses of an uninterrupted run without a local tier; a worker whose node-local copies vanish with
it makes *every* rank resume from checkpoint.dir (step 6), again bitwise; checkpoint.dir never
holds a local-only step; a finished run leaves no local copies behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runs import read_events, run_launch, step_losses, write_config

STEPS = 12
SAVES = {"interval_steps": 2, "keep_last": 10}


def _run(tmp_path: Path, token_file: str, name: str, fault: str | None, local: bool) -> Path:
    run_dir = tmp_path / name
    ckpt = dict(SAVES, **({"local_dir": str(tmp_path / f"{name}-local"), "remote_every": 3} if local else {}))
    cfg = write_config(
        tmp_path / f"{name}.toml",
        token_file,
        run_dir,
        train={"steps": STEPS},
        checkpoint=ckpt,
        elastic={"max_restarts": 1},
    )
    r = run_launch(cfg, "--nproc-per-node", "2", env={"ELASTIC_TRAINER_INJECT_FAULT": fault} if fault else None)
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]
    return run_dir


@pytest.fixture(scope="module")
def ref(tmp_path_factory, token_file):
    return step_losses(_run(tmp_path_factory.mktemp("lt-ref"), token_file, "ref", None, local=False))


def _committed(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run_dir / "ckpt").glob("step-*/manifest.json"))


def test_a_killed_worker_resumes_from_the_local_tier_bitwise(tmp_path, token_file, ref):
    run = _run(tmp_path, token_file, "killed", "kill@rank=1,step=11", local=True)
    (resume,) = read_events(run, "resume")
    # 10 when its copy was complete on both ranks when rank 1 died (the save overlaps step 11), else 8
    assert resume["tier"] == "local" and resume["step"] in (8, 10), resume
    assert step_losses(run) == ref  # bitwise
    assert _committed(run) == [6, 12]  # local-only steps never reach checkpoint.dir
    local_saved = sorted({e["step"] for e in read_events(run, "checkpoint_local_saved")})
    assert local_saved == [2, 4, 6, 8, 10, 12], local_saved
    assert not any((tmp_path / "killed-local").rglob("*.distcp")), "a finished run drops its local copies"


def _every_rank_resumed_from_checkpoint_dir(run: Path, ref: dict, why: str) -> None:
    (resume,) = read_events(run, "resume")
    assert (resume["step"], resume["tier"]) == (6, "remote"), resume
    (skipped,) = read_events(run, "checkpoint_local_skipped")
    assert skipped["step"] in (8, 10) and why in skipped["reason"], skipped
    assert step_losses(run) == ref  # bitwise
    assert _committed(run) == [6, 12]


def test_a_lost_node_resumes_every_rank_from_checkpoint_dir_bitwise(tmp_path, token_file, ref):
    run = _run(tmp_path, token_file, "lost", "lose_local@rank=1,step=11", local=True)
    _every_rank_resumed_from_checkpoint_dir(run, ref, "rank 1")


@pytest.mark.soak  # tests/dist/test_local_tier.py corrupts a copy at the same size on every run
def test_a_corrupted_local_copy_resumes_every_rank_from_checkpoint_dir_bitwise(tmp_path, token_file, ref):
    run = _run(tmp_path, token_file, "corrupt", "corrupt_local@rank=1,step=11", local=True)
    _every_rank_resumed_from_checkpoint_dir(run, ref, "load failed")
