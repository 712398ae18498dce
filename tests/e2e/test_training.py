"""End to end under the elastic agent: world-size invariance, the event log, the demo learns."""

import json
import math
from pathlib import Path

import pytest

from tests import runs


@pytest.fixture(scope="module")
def by_world(tmp_path_factory, token_file):
    """10 steps of the tiny config at world sizes 1..3 (separate runs, same config): 3 is the
    uneven split; world 4 is covered by test_resume's 4->2 reshard and tests/dist."""
    out = {}
    for w in (1, 2, 3):
        d = tmp_path_factory.mktemp(f"w{w}")
        cfg = runs.write_config(d / "c.toml", token_file, d / "run")
        r = runs.run_launch(cfg, "--nproc-per-node", str(w))
        assert r.returncode == 0, (cfg.with_suffix(".log")).read_text()[-3000:]
        out[w] = d / "run"
    return out


def test_losses_are_world_size_invariant(by_world):
    ref = runs.step_losses(by_world[1])
    assert sorted(ref) == list(range(1, 11))
    for w in (2, 3):
        got = runs.step_losses(by_world[w])
        assert sorted(got) == sorted(ref)
        for s in ref:
            assert runs.close_rel(ref[s], got[s], 1e-5), (w, s, ref[s], got[s])


def test_step_records_have_the_contract_fields(by_world):
    steps = runs.read_events(by_world[3], "step")
    assert len(steps) == 10
    for r in steps:
        assert {"event", "step", "loss", "lr", "grad_norm", "world_size", "step_time_s", "tokens_per_s"} <= set(r)
        assert r["world_size"] == 3 and math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    names = [r["event"] for r in runs.read_events(by_world[3])]
    assert names[0] == "launch" and "start" in names and names.count("checkpoint_committed") == 2
    assert names[-2:] == ["finished", "supervisor_exit"]


def test_demo_config_learns(tmp_path):
    data = tmp_path / "demo.bin"
    from elastic_trainer.worker.tokens import build_token_file, default_demo_texts

    build_token_file(default_demo_texts(2 << 20), str(data))
    run_dir = tmp_path / "demo"
    cfg = Path("configs/demo-cpu.toml").resolve()
    r = runs.run_launch(
        cfg,
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"checkpoint.dir={run_dir}/ckpt",
        "--set",
        f"data.path={data}",
        "--set",
        "train.steps=40",
        "--set",
        "train.warmup_steps=5",
        "--set",
        "checkpoint.interval_steps=20",
        log=tmp_path / "demo.log",
        env={"OMP_NUM_THREADS": None},
    )
    screen = (tmp_path / "demo.log").read_text()
    assert r.returncode == 0, screen[-3000:]
    losses = runs.step_losses(run_dir)
    first, last = losses[1], sum(losses[s] for s in range(36, 41)) / 5
    assert last < first - 1.5, (first, last)
    # The first screen is a user's: no warnings or banners, no config dump, commits in the
    # progress line, and a closing summary saying where everything is.
    lines = screen.strip().splitlines()
    assert not [
        line for line in lines if "warning" in line.lower() or "OMP_NUM_THREADS" in line or "config: {" in line
    ], screen
    assert (
        "| world 2 | ckpt step 20 committed, next in 20 steps" in screen
        and "checkpoint step 20 committed" not in screen
    )
    assert (
        lines[-4].startswith("finished at step 40/40: ")
        and "goodput" in lines[-4]
        and "2 checkpoint(s) committed" in lines[-4]
    ), screen
    assert f"checkpoints: {run_dir}/ckpt (newest commit: step 40)" in lines[-3]
    assert f"report:      elastic-trainer report {run_dir}" in lines[-2]
    assert lines[-1].strip().startswith("train longer: elastic-trainer launch") and "train.steps=N" in lines[-1]
    assert (run_dir / "config.json").exists() and json.loads((run_dir / "config.json").read_text())["train"][
        "steps"
    ] == 40


def test_bf16_mixed_precision_runs_on_cpu_and_checkpoints_fp32(tmp_path, token_file):
    cfg = runs.write_config(
        tmp_path / "c.toml",
        token_file,
        tmp_path / "run",
        train={"mixed_precision": "bf16", "steps": 4},
        checkpoint={"interval_steps": 4},
    )
    r = runs.run_launch(cfg)
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-3000:]
    assert all(math.isfinite(v) for v in runs.step_losses(tmp_path / "run").values())
    from elastic_trainer.checkpoint.tools import inspect_checkpoint

    entries = inspect_checkpoint(str(tmp_path / "run" / "ckpt"))["entries"]
    weights = {k: v for k, v in entries.items() if k.startswith("model.")}
    moments = {
        k: v for k, v in entries.items() if k.startswith("optim.state.") and k.endswith(("exp_avg", "exp_avg_sq"))
    }
    assert weights and moments
    assert {v["dtype"] for v in weights.values()} == {"float32"}, "master weights are fp32"
    assert {v["dtype"] for v in moments.values()} == {"float32"}


def test_retention_keeps_last_and_every(tmp_path, token_file):
    cfg = runs.write_config(
        tmp_path / "c.toml",
        token_file,
        tmp_path / "run",
        checkpoint={"interval_steps": 2, "keep_last": 2, "keep_every": 4},
    )
    r = runs.run_launch(cfg)
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-3000:]
    ckpt = tmp_path / "run" / "ckpt"
    # Reserved ``_`` directories (fencing epochs, the event mirror) sit beside the checkpoints.
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("_")) == [
        "step-00000004",
        "step-00000008",
        "step-00000010",
    ]
    assert [e["step"] for e in runs.read_events(tmp_path / "run", "checkpoint_committed")] == [2, 4, 6, 8, 10]
    deleted = sorted(e["step"] for e in runs.read_events(tmp_path / "run", "checkpoint_deleted"))
    assert deleted == [2, 6]


def test_time_based_saves_are_agreed_by_all_ranks(tmp_path, token_file):
    """No step-based cadence; a save whenever 0.3 s have passed. Ranks must agree on the step
    (a disagreement would deadlock the save's collectives or mismatch the shards)."""
    cfg = runs.write_config(
        tmp_path / "c.toml",
        token_file,
        tmp_path / "run",
        train={"steps": 12},
        checkpoint={"interval_steps": 0, "interval_seconds": 0.3, "keep_last": 50},
    )
    r = runs.run_launch(cfg, "--nproc-per-node", "3")
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-3000:]
    steps = [e["step"] for e in runs.read_events(tmp_path / "run", "checkpoint_committed")]
    assert steps[-1] == 12 and len(steps) >= 2, steps
    assert not runs.read_events(tmp_path / "run", "checkpoint_failed")
