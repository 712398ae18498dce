"""Exact resume of runs that draw randomness or read a growing data set (issue #11), with real
``elastic-trainer launch`` runs at world size 2:

* the demo model with ``model.dropout`` and a Hugging Face Llama with ``attention_dropout``:
  SIGKILLs at two points, two automatic resumes, bitwise the losses of an uninterrupted run;
* a ``data.path`` glob that gains a file between a kill and the resume: the resume reads the
  files recorded at the first start (same losses as the uninterrupted run) and says so in a
  ``data_view_frozen`` event; a recorded file that vanished stops the resume naming it;
* bad token files stop the launch with a one-line config error before any worker starts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from elastic_trainer.supervisor.policy import BACKOFF_RESET_SECONDS
from tests.runs import REPO, env_for_tests, read_events, run_cli, run_launch, step_losses, write_config

STEPS = 10
HF_CONFIG = REPO / "tests" / "data" / "hf" / "tiny-llama"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# Saves at 3, 6, 9, 10. Rank 1 dies at the start of step 6 (resume from 3), then rank 0 of the
# restarted group at the start of step 9 (resume from 6); each once that save has committed.
TWO_KILLS = "kill@rank=1,step=6,committed=3;kill@rank=0,step=9,restart=1,committed=6"


def _launch(cfg: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    r = run_launch(cfg, "--nproc-per-node", "2", env={**OFFLINE, **(env or {})})
    return r


def _all_losses(run_dir: Path) -> list[float]:
    got = step_losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    return [got[s] for s in range(1, STEPS + 1)]


def _killed_twice_matches_uninterrupted(tmp_path: Path, data_path: str, **sections) -> None:
    runs = {}
    for name, env in (("ref", None), ("killed", {"ELASTIC_TRAINER_INJECT_FAULT": TWO_KILLS})):
        run_dir = tmp_path / name
        cfg = write_config(
            tmp_path / f"{name}.toml",
            data_path,
            run_dir,
            train={"steps": STEPS},
            checkpoint={"interval_steps": 3, "keep_last": 5},
            elastic={"max_restarts": 2},
            **sections,
        )
        r = _launch(cfg, env)
        assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]
        runs[name] = run_dir
    resumes = read_events(runs["killed"], "resume")
    assert [(e["step"], e["rng"]) for e in resumes] == [(3, "restored"), (6, "restored")], resumes
    assert not read_events(runs["ref"], "resume")
    assert _all_losses(runs["killed"]) == _all_losses(runs["ref"])  # bitwise
    # The second generation committed step 6 before it was killed: the job moves forward
    # between failures, so its restart is not backed off as a crash loop's would be.
    first, second = read_events(runs["killed"], "restart")
    assert second["backoff_seconds"] == 0, second
    if second["mono"] - first["mono"] < BACKOFF_RESET_SECONDS:
        assert second["progressed"] is True, second


def test_demo_model_with_dropout_resumes_bitwise_after_sigkills(tmp_path, token_file):
    _killed_twice_matches_uninterrupted(tmp_path, token_file, model={"dropout": 0.1})


@pytest.mark.soak  # test_user_models kills an HF model and resumes it bitwise in every run
def test_hf_model_with_attention_dropout_resumes_bitwise_after_sigkills(tmp_path, token_file):
    pytest.importorskip("transformers")
    conf = json.loads((HF_CONFIG / "config.json").read_text())
    conf["attention_dropout"] = 0.1
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(conf))
    model = {
        "factory": "elastic_trainer.models.hf:causal_lm",
        "hf_config": str(tmp_path / "hf"),
        "vocab_size": 512,
        "seq_len": 32,
    }
    _killed_twice_matches_uninterrupted(tmp_path, token_file, model=model)


def _token_parquet(path: Path, tokens: np.ndarray, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    rows, start = [], 0
    while start < len(tokens):
        n = int(rng.integers(20, 200))
        rows.append(tokens[start : start + n].astype(np.int64).tolist())
        start += n
    pq.write_table(pa.table({"input_ids": rows}), path)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, token_file) -> list[Path]:
    pytest.importorskip("pyarrow")
    root = tmp_path_factory.mktemp("shards")
    tokens = np.fromfile(token_file, dtype=np.uint16)[:150_000]
    out = []
    for i, part in enumerate(np.array_split(tokens, 3)):
        _token_parquet(root / f"part-{i}.parquet", part, seed=i)
        out.append(root / f"part-{i}.parquet")
    return out


def test_a_glob_that_gains_a_file_resumes_on_the_files_of_the_first_start(tmp_path, shards):
    data = {"format": "tokens"}
    ref_dir, data_dir = tmp_path / "ref-data", tmp_path / "data"
    for d in (ref_dir, data_dir):
        d.mkdir()
        for s in shards[:2]:
            shutil.copy(s, d / s.name)
    ref_cfg = write_config(tmp_path / "ref.toml", str(ref_dir / "*.parquet"), tmp_path / "ref", data=data)
    assert _launch(ref_cfg).returncode == 0, ref_cfg.with_suffix(".log").read_text()[-4000:]

    run = tmp_path / "run"
    cfg = write_config(tmp_path / "c.toml", str(data_dir / "*.parquet"), run, data=data)
    r = _launch(cfg, {"ELASTIC_TRAINER_INJECT_FAULT": "kill@rank=1,step=8,committed=5"})  # no restarts: the job ends
    assert r.returncode != 0 and (run / "ckpt" / "step-00000005" / "manifest.json").exists()
    added = data_dir / "part-2.parquet"
    shutil.copy(shards[2], added)  # sorts last: without the frozen view, the stream would grow
    assert _launch(cfg).returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]

    (resume,) = read_events(run, "resume")
    assert resume["step"] == 5 and resume["data_view"] == "recorded"
    (frozen,) = read_events(run, "data_view_frozen")
    assert frozen["ignored"] == [str(added)] and frozen["files"] == 2
    ref = step_losses(tmp_path / "ref")
    assert step_losses(run) == ref and sorted(ref) == list(range(1, STEPS + 1))

    # A file the run read is gone: the launch stops before any worker starts, naming it.
    starts = len(read_events(run, "start"))
    (data_dir / "part-0.parquet").unlink()
    log = cfg.with_suffix(".log")
    log.write_text("")
    assert _launch(cfg).returncode == 2, log.read_text()[-3000:]
    lines = [ln for ln in log.read_text().splitlines() if "config error" in ln]
    assert (
        lines and "config error at 'data.path'" in lines[-1] and f"{data_dir / 'part-0.parquet'} is gone" in lines[-1]
    ), log.read_text()[-3000:]
    assert len(read_events(run, "start")) == starts, "a worker started"


def _bad_launch(tmp_path: Path, data_path: str) -> subprocess.CompletedProcess:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "c.toml", data_path, run_dir)
    proc = run_cli(
        [sys.executable, "-m", "elastic_trainer.cli", "launch", str(cfg), "--nproc-per-node", "2"], env_for_tests(), 120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert not read_events(run_dir, "start"), "a worker started"
    return proc


def test_a_bad_token_id_far_into_the_file_stops_the_launch(tmp_path):
    tokens = np.full((1 << 20) + 5000, 7, dtype=np.uint16)
    tokens[(1 << 20) + 4321] = 300  # past the first 2^20 tokens; model.vocab_size is 256
    tokens.tofile(tmp_path / "t.bin")
    err = _bad_launch(tmp_path, str(tmp_path / "t.bin")).stderr
    line = [ln for ln in err.splitlines() if "config error" in ln]
    assert line and "config error at 'model.vocab_size'" in line[-1] and "token id 300 at token 1052897" in line[-1], (
        err[-3000:]
    )


def test_an_empty_token_file_stops_the_launch(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    err = _bad_launch(tmp_path, str(tmp_path / "empty.bin")).stderr
    assert f"config error at 'data.path': {tmp_path / 'empty.bin'} is empty" in err, err[-3000:]
