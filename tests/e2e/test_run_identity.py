"""What a checkpoint belongs to, and which lineage a restart continues (issue #11, items 2-3).

* A resume with a run-defining key changed fails before any worker starts, naming each key;
  ``checkpoint.allow_changes`` lets it through and the change is recorded in an event.
* ``checkpoint.resume = <step>`` decides the first start of a launch only: a worker failure
  afterwards resumes from the newest commit of the new branch, never from the abandoned newer
  commits, which ``ckpt list`` shows as parked.
"""

from __future__ import annotations

import json

import pytest

from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.config import check_run_identity, load_config, run_changes
from elastic_trainer.errors import RunChangedError
from elastic_trainer.storage.fs import open_storage
from tests import runs


def _launch(cfg, *args, env=None, code=0):
    r = runs.run_launch(cfg, *args, env=env)
    assert r.returncode == code, cfg.with_suffix(".log").read_text()[-4000:]
    return r


def test_run_changes_table():
    recorded = {"train.seed": 1, "train.global_batch_size": 8, "model.dim": 32}
    current = {"train.seed": 2, "train.global_batch_size": 16, "model.dim": 32}
    refused, allowed = run_changes(recorded, current, ["train.global_batch_size"])
    assert refused == [("train.seed", 1, 2)] and allowed == [("train.global_batch_size", 8, 16)]
    assert run_changes({}, current, []) == ([], []), "a checkpoint without a recorded identity is not compared"


def test_hf_config_content_is_part_of_the_identity(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"rope_theta": 10000.0}))
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(f'[model]\nfactory = "elastic_trainer.models.hf:causal_lm"\nhf_config = "{hf}"\n')
    before = load_config(cfg_file).run_identity()
    (hf / "config.json").write_text(json.dumps({"rope_theta": 500000.0}))  # same path, other content
    after = load_config(cfg_file)
    with pytest.raises(RunChangedError, match="model.hf_config"):
        check_run_identity(after, before)


def test_changed_run_keys_are_named_before_start_and_allowed_on_request(tmp_path, token_file):
    run = tmp_path / "run"
    first = runs.write_config(tmp_path / "a.toml", token_file, run, train={"steps": 5})
    _launch(first)
    changed = runs.write_config(
        tmp_path / "b.toml", token_file, run, train={"steps": 8, "seed": 99, "global_batch_size": 12}
    )
    starts_before = len(runs.read_events(run, "start"))
    r = runs.run_cli(runs.launch_args(changed), runs.env_for_tests(), 120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "config error at 'train.seed': checkpoint has 7, config has 99" in r.stderr
    assert "config error at 'train.global_batch_size': checkpoint has 10, config has 12" in r.stderr
    assert len(runs.read_events(run, "start")) == starts_before, "no worker started"
    _launch(changed, "--set", "checkpoint.allow_changes=train.seed,train.global_batch_size")
    (ev,) = runs.read_events(run, "config_changed")
    assert {c["key"] for c in ev["changes"]} == {"train.seed", "train.global_batch_size"} and ev["step"] == 5
    assert max(runs.step_losses(run)) == 8


def test_pinned_resume_decides_the_first_start_only_and_parks_the_abandoned_branch(tmp_path, token_file):
    run = tmp_path / "run"
    ckpt = run / "ckpt"
    base = runs.write_config(
        tmp_path / "a.toml", token_file, run, train={"steps": 10}, checkpoint={"interval_steps": 2, "keep_last": 10}
    )
    _launch(base)  # commits 2, 4, 6, 8, 10
    # Start again from step 4 (a new branch); rank 1 fails at step 7 of the first incarnation.
    pinned = runs.write_config(
        tmp_path / "b.toml",
        token_file,
        run,
        train={"steps": 10},
        checkpoint={"interval_steps": 2, "keep_last": 2, "resume": "4"},
        elastic={"max_restarts": 1},
    )
    _launch(pinned, env={"ELASTIC_TRAINER_INJECT_FAULT": "raise@rank=1,step=7"})
    resumes = runs.read_events(run, "resume")[-2:]
    assert [r["step"] for r in resumes] == [4, 6], (
        "first start: the pinned step; the restart: the new branch's newest commit"
    )
    head = Catalog(open_storage(str(ckpt))).head()
    assert head.name == "step-00000010.1", "latest = the new branch's head, not the abandoned step-00000010"
    rows = {r["name"]: r for r in _ckpt_list(ckpt)}
    # The old branch's 6/8/10 are parked (still there, never picked); the new branch wrote .1 directories.
    assert sorted(n for n, r in rows.items() if r["status"] == "parked") == [
        "step-00000006",
        "step-00000008",
        "step-00000010",
    ], rows
    # Retention (keep_last=2) pruned only the new lineage; nothing parked was deleted.
    assert sorted(n for n, r in rows.items() if r["status"] in ("head", "lineage")) == [
        "step-00000008.1",
        "step-00000010.1",
    ], rows


def _ckpt_list(ckpt) -> list[dict]:
    from elastic_trainer.checkpoint.tools import list_checkpoints

    return list_checkpoints(str(ckpt))
