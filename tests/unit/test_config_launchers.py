"""Configuration under any launcher (``python``, ``torchrun``, ``accelerate launch``, ``run``):
``ELASTIC_TRAINER_CONFIG`` and ``ELASTIC_TRAINER_SET`` as the command line, one precedence rule,
and one default checkpoint root (or a refusal naming both). No process group."""

from __future__ import annotations

import json
import logging
import os

import pytest

from elastic_trainer import contract
from elastic_trainer.config import EnvSettings, keys_set, load_config, split_overrides
from elastic_trainer.errors import ConfigError
from elastic_trainer.runtime.session import check_other_roots, resolve, resolve_config


@pytest.fixture
def bare(monkeypatch, tmp_path):
    """No supervisor, no environment settings, the script ``train.py``, in ``tmp_path``."""
    for name in (contract.CONFIG_ENV, contract.CONFIG_SET_ENV, contract.CONFIG_FILE_ENV, contract.OVERRIDES_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["train.py"])
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def _commit(root, step: int = 3) -> None:
    """A directory that lists as committed (its commit marker; nothing is read)."""
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")


def test_the_overrides_variable_takes_lines_or_semicolons():
    assert split_overrides("train.seed=3; train.steps=4\ncheckpoint.dir=s3://b/p\n\n ;") == [
        "train.seed=3",
        "train.steps=4",
        "checkpoint.dir=s3://b/p",
    ]
    env = EnvSettings.from_env({contract.CONFIG_FILE_ENV: "job.toml", contract.OVERRIDES_ENV: "train.seed=3"})
    assert env == EnvSettings("job.toml", ("train.seed=3",))
    assert EnvSettings.from_env({}) == EnvSettings()


def test_the_file_and_overrides_of_the_environment_count_as_the_command_line(bare, tmp_path, caplog):
    job = tmp_path / "job.toml"
    job.write_text('[checkpoint]\ndir = "s3://bucket/job"\ninterval_steps = 7\n[train]\nseed = 1\n')
    bare.setenv(contract.CONFIG_FILE_ENV, str(job))
    bare.setenv(contract.OVERRIDES_ENV, "train.seed=9\ntrain.steps=3")
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.runtime.session"):
        cfg = resolve_config(None, ["checkpoint.interval_steps=5", "train.seed=2", "train.lr=0.5"])
    assert cfg.checkpoint.dir == "s3://bucket/job", "the file's checkpoint.dir"
    assert (cfg.checkpoint.interval_steps, cfg.train.seed, cfg.train.steps) == (7, 9, 3), "the environment wins"
    assert cfg.train.lr == 0.5, "what the environment leaves alone the script sets"
    assert cfg.run.dir == "runs/job", "the file names the run, as `run --config` does"
    assert "checkpoint.interval_steps=5" in caplog.text and "train.seed=2" in caplog.text, "never silently replaced"
    with pytest.raises(ConfigError, match="checkpoint.dir.*ELASTIC_TRAINER_SET"):
        resolve_config(None, ["checkpoint.dir=/elsewhere"])


def test_under_run_the_same_file_and_overrides_give_the_same_config(bare, tmp_path):
    """`run --config FILE --set ...` and ELASTIC_TRAINER_CONFIG/ELASTIC_TRAINER_SET under torchrun:
    the same resolved config for the same script."""
    job = tmp_path / "job.toml"
    job.write_text("[train]\nseed = 4\n")
    bare.setenv(contract.CONFIG_FILE_ENV, str(job))
    bare.setenv(contract.OVERRIDES_ENV, "checkpoint.keep_last=2")
    plain = resolve_config(None, ["train.seed=1", "train.steps=11"])
    bare.delenv(contract.CONFIG_FILE_ENV)
    bare.delenv(contract.OVERRIDES_ENV)
    sup = load_config(str(job), ["checkpoint.keep_last=2"], name="job")
    bare.setenv(contract.CONFIG_ENV, sup.to_json())
    bare.setenv(contract.CONFIG_SET_ENV, json.dumps(keys_set(str(job), ["checkpoint.keep_last=2"])))
    assert resolve_config(None, ["train.seed=1", "train.steps=11"]) == plain


def test_a_bad_file_or_item_names_the_variable(bare, tmp_path):
    bare.setenv(contract.CONFIG_FILE_ENV, str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="ELASTIC_TRAINER_CONFIG.*no such file"):
        resolve_config()
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    bare.setenv(contract.CONFIG_FILE_ENV, str(bad))
    with pytest.raises(ConfigError, match="ELASTIC_TRAINER_CONFIG.*not valid TOML"):
        resolve_config()
    bare.delenv(contract.CONFIG_FILE_ENV)
    bare.setenv(contract.OVERRIDES_ENV, "train.seed")
    with pytest.raises(ConfigError, match="ELASTIC_TRAINER_SET"):
        resolve_config()
    bare.setenv(contract.OVERRIDES_ENV, "train.nope=1")
    with pytest.raises(ConfigError, match="train.nope.*unknown key"):
        resolve_config()


def test_one_default_root_for_every_launcher(bare, tmp_path):
    """Nothing sets the paths: `runs/<script>/checkpoints` under python/torchrun as under run;
    a TOML path given to et.init no longer names the run (its old root is checked instead)."""
    job = tmp_path / "job.toml"
    job.write_text("[train]\nseed = 4\n")
    r = resolve(str(job))
    assert (r.cfg.run.dir, r.cfg.checkpoint.dir) == ("runs/train", "runs/train/checkpoints")
    assert r.others == ("runs/job/checkpoints",)
    front = ["run.dir=proj", "checkpoint.dir=proj/checkpoints"]  # Accelerate's project_dir
    r = resolve(None, (), front)
    assert (r.cfg.run.dir, r.cfg.checkpoint.dir, r.others) == ("proj", "proj/checkpoints", ("runs/train/checkpoints",))
    bare.setenv(contract.OVERRIDES_ENV, "checkpoint.dir=/data/ck")
    r = resolve(None, (), front)
    assert (r.cfg.run.dir, r.cfg.checkpoint.dir, r.others) == ("proj", "/data/ck", ()), "set explicitly: no check"
    bare.delenv(contract.OVERRIDES_ENV)
    sup = load_config(None, [], name="train")
    bare.setenv(contract.CONFIG_ENV, sup.to_json())
    r = resolve(None, (), front)
    assert (r.cfg.checkpoint.dir, r.others) == ("runs/train/checkpoints", ("proj/checkpoints",))
    bare.setenv(contract.CONFIG_SET_ENV, json.dumps(["checkpoint.dir"]))
    assert resolve(None, (), front).others == (), "the run command line set it"


@pytest.mark.parametrize("under_run", [False, True])
def test_a_default_root_without_commits_refuses_when_the_other_launcher_s_has_some(bare, tmp_path, under_run):
    front = ["run.dir=proj", "checkpoint.dir=proj/checkpoints"]
    if under_run:
        bare.setenv(contract.CONFIG_ENV, load_config(None, [], name="train").to_json())
    here, other = (
        ("runs/train/checkpoints", "proj/checkpoints") if under_run else ("proj/checkpoints", "runs/train/checkpoints")
    )
    check_other_roots(resolve(None, (), front))  # nothing anywhere: a fresh start
    _commit(tmp_path / other)
    with pytest.raises(ConfigError, match="checkpoint.dir") as e:
        check_other_roots(resolve(None, (), front))
    assert here in str(e.value) and other in str(e.value), "names both"
    _commit(tmp_path / here, 5)
    check_other_roots(resolve(None, (), front))  # this root has commits: it resumes
    assert os.path.isdir(tmp_path / other)
