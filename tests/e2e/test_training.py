"""End to end under the elastic agent: world-size invariance, the event log, the demo learns."""

import math
from pathlib import Path

import pytest

from tests import runs


@pytest.fixture(scope="module")
def by_world(tmp_path_factory, token_file):
    """10 steps of the tiny config at world sizes 1..4 (separate runs, same config)."""
    out = {}
    for w in (1, 2, 3, 4):
        d = tmp_path_factory.mktemp(f"w{w}")
        cfg = runs.write_config(d / "c.toml", token_file, d / "run")
        r = runs.run_launch(cfg, "--nproc-per-node", str(w))
        assert r.returncode == 0, (cfg.with_suffix(".log")).read_text()[-3000:]
        out[w] = d / "run"
    return out


def test_losses_are_world_size_invariant(by_world):
    ref = runs.step_losses(by_world[1])
    assert sorted(ref) == list(range(1, 11))
    for w in (2, 3, 4):
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
    from elastic_trainer.worker.data import build_token_file, default_demo_texts

    build_token_file(default_demo_texts(2 << 20), str(data))
    run_dir = tmp_path / "demo"
    cfg = Path("configs/demo-cpu.toml").resolve()
    r = runs.run_launch(
        cfg,
        "--set", f"run.dir={run_dir}", "--set", f"checkpoint.dir={run_dir}/ckpt", "--set", f"data.path={data}",
        "--set", "train.steps=40", "--set", "train.warmup_steps=5", "--set", "checkpoint.interval_steps=20",
        log=tmp_path / "demo.log",
    )
    assert r.returncode == 0, (tmp_path / "demo.log").read_text()[-3000:]
    losses = runs.step_losses(run_dir)
    first, last = losses[1], sum(losses[s] for s in range(36, 41)) / 5
    assert last < first - 1.5, (first, last)


def test_bf16_mixed_precision_runs_on_cpu_and_checkpoints_fp32(tmp_path, token_file):
    cfg = runs.write_config(tmp_path / "c.toml", token_file, tmp_path / "run", train={"mixed_precision": "bf16", "steps": 4}, checkpoint={"interval_steps": 4})
    r = runs.run_launch(cfg)
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-3000:]
    assert all(math.isfinite(v) for v in runs.step_losses(tmp_path / "run").values())
    from elastic_trainer.checkpoint.tools import inspect_checkpoint

    entries = inspect_checkpoint(str(tmp_path / "run" / "ckpt"))["entries"]
    weights = {k: v for k, v in entries.items() if k.startswith("model.")}
    moments = {k: v for k, v in entries.items() if k.startswith("optim.state.") and k.endswith(("exp_avg", "exp_avg_sq"))}
    assert weights and moments
    assert {v["dtype"] for v in weights.values()} == {"float32"}, "master weights are fp32"
    assert {v["dtype"] for v in moments.values()} == {"float32"}
