"""Every class of bad config input fails with a ConfigError that names the key."""

import subprocess
import sys

import pytest

from elastic_trainer.config import check_world_size, config_from_dict, load_config
from elastic_trainer.errors import ConfigError


def test_defaults_are_valid():
    cfg = load_config(None)
    assert cfg.train.steps > 0 and cfg.checkpoint.interval_steps > 0


def test_demo_and_cluster_configs_load():
    load_config("configs/demo-cpu.toml")
    load_config("configs/gpt-1b-cluster.toml")


@pytest.mark.parametrize(
    "key, value",
    [
        ("dir", "s3://AKIAEXAMPLE:sEcReT/42@bucket/run"),
        ("dir", "s3://akiaexample:secret42@bucket/run"),  # lower case: a valid-looking bucket before the @
        ("dir", "file://user:secret42@host/data/ckpt"),
        ("dir", "memory://user:secret42@x/ckpt"),
        ("s3_endpoint_url", "http://minio:secret42@127.0.0.1:9000"),
    ],
)
def test_credentials_in_a_url_are_refused_without_being_echoed(key, value):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"checkpoint": {key: value}})
    assert e.value.key == f"checkpoint.{key}"
    assert "credentials in a URL are not accepted" in str(e.value) and "***@" in str(e.value)
    assert "secret42" not in str(e.value) and "sEcReT" not in str(e.value)


@pytest.mark.parametrize(
    "data, key, fragment",
    [
        ({"trian": {"steps": 1}}, "trian", "unknown section"),
        ({"train": {"stepz": 1}}, "train.stepz", "unknown key"),
        ({"train": {"steps": "ten"}}, "train.steps", "expected an integer"),
        ({"train": {"steps": 1.5}}, "train.steps", "expected an integer"),
        ({"train": {"lr": "fast"}}, "train.lr", "expected a number"),
        ({"train": {"steps": 0}}, "train.steps", "must be > 0"),
        (
            {"train": {"global_batch_size": 4, "micro_batch_size": 8}},
            "train.micro_batch_size",
            "larger than train.global_batch_size",
        ),
        ({"train": {"mixed_precision": "fp8"}}, "train.mixed_precision", "expected auto, fp32 or bf16"),
        ({"model": {"dim": 100, "n_heads": 3}}, "model.dim", "not divisible"),
        ({"model": {"factory": "nocolon"}}, "model.factory", "package.module:function"),
        ({"model": {"shard_modules": "Block"}}, "model.shard_modules", "expected a list"),
        ({"data": {"dtype": "int8"}}, "data.dtype", "uint16 or uint32"),
        ({"model": {"vocab_size": 70000}}, "model.vocab_size", "does not fit data.dtype=uint16"),
        ({"checkpoint": {"dir": "gs://bucket/x"}}, "checkpoint.dir", "unsupported scheme"),
        ({"checkpoint": {"dir": "s3://Bad_Bucket/x"}}, "checkpoint.dir", "invalid S3 bucket"),
        ({"checkpoint": {"dir": "s3://bucket:9000/x"}}, "checkpoint.dir", "host:port goes in checkpoint.s3_endpoint"),
        ({"checkpoint": {"dir": "s3://-bucket/x"}}, "checkpoint.dir", "invalid S3 bucket"),
        ({"checkpoint": {"dir": "file://relative/x"}}, "checkpoint.dir", "must be absolute"),
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last", ">= 1"),
        ({"checkpoint": {"resume": "yesterday"}}, "checkpoint.resume", "'latest', 'none' or a step"),
        ({"checkpoint": {"mode": "eventually"}}, "checkpoint.mode", "async or sync"),
        ({"checkpoint": {"s3_endpoint_url": "localhost:9000"}}, "checkpoint.s3_endpoint_url", "http(s) URL"),
        ({"checkpoint": {"local_dir": "s3://bucket/x"}}, "checkpoint.local_dir", "node-local path"),
        (
            {"checkpoint": {"dir": "/data/ckpt", "local_dir": "/data/ckpt/local"}},
            "checkpoint.local_dir",
            "must not overlap checkpoint.dir",
        ),
        (
            {"checkpoint": {"dir": "/data/ckpt/remote", "local_dir": "/data/ckpt"}},
            "checkpoint.local_dir",
            "must not overlap checkpoint.dir",
        ),
        ({"checkpoint": {"remote_every": 3}}, "checkpoint.remote_every", "needs checkpoint.local_dir"),
        ({"checkpoint": {"local_dir": "/dev/shm/x", "remote_every": 0}}, "checkpoint.remote_every", ">= 1"),
        ({"checkpoint": {"peer_replicas": -1}}, "checkpoint.peer_replicas", ">= 0"),
        ({"elastic": {"nnodes": "3:1"}}, "elastic.nnodes", "MIN <= MAX"),
        ({"elastic": {"nnodes": "two"}}, "elastic.nnodes", "N or MIN:MAX"),
        ({"elastic": {"hang_timeout_seconds": 1}}, "elastic.hang_timeout_seconds", ">= 5"),
        ({"elastic": {"rdzv_poll_seconds": 0}}, "elastic.rdzv_poll_seconds", "> 0 and <= 1"),
        ({"elastic": {"rdzv_poll_seconds": 2}}, "elastic.rdzv_poll_seconds", "> 0 and <= 1"),
        ({"metrics": {"port": 70000}}, "metrics.port", "0..65535"),
        ({"run": "x"}, "run", "must be a table"),
    ],
)
def test_bad_values_name_the_key(data, key, fragment):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert e.value.key == key
    assert f"'{key}'" in str(e.value) and fragment in str(e.value)


def test_the_process_writer_on_a_torch_it_does_not_finish_on_is_refused_by_name(monkeypatch):
    from elastic_trainer import config

    monkeypatch.setattr("importlib.metadata.version", lambda name: "2.13.0+cpu")
    assert config_from_dict({"checkpoint": {"writer": "process"}}).checkpoint.writer == "process"
    monkeypatch.setattr("importlib.metadata.version", lambda name: "2.11.0+cu130")
    with pytest.raises(ConfigError) as e:
        config_from_dict({"checkpoint": {"writer": "process"}})
    assert e.value.key == "checkpoint.writer" and "torch>=2.13 (installed: 2.11)" in str(e.value)
    assert config_from_dict({}).checkpoint.writer == "thread"  # the default stays valid there
    assert config.torch_release() == (2, 11)


def test_global_batch_that_cannot_be_split():
    cfg = config_from_dict({"train": {"global_batch_size": 2, "micro_batch_size": 1}})
    with pytest.raises(ConfigError, match="train.global_batch_size.*cannot be split across 3 ranks"):
        check_world_size(cfg, 3)
    check_world_size(cfg, 2)


def test_overrides_and_their_errors(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[train]\nsteps = 5\n[checkpoint]\ndir = "/tmp/x"\n')
    cfg = load_config(
        p,
        ["train.steps=7", "checkpoint.dir=s3://bucket/prefix", "checkpoint.resume=12", 'model.shard_modules=["Block"]'],
    )
    assert cfg.train.steps == 7 and cfg.checkpoint.dir == "s3://bucket/prefix" and cfg.checkpoint.resume == "12"
    assert cfg.model.shard_modules == ["Block"]
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(p, ["train.steps"])
    with pytest.raises(ConfigError, match="section.key"):
        load_config(p, ["steps=3"])
    with pytest.raises(ConfigError) as e:
        load_config(p, ["train.steps=many"])
    assert e.value.key == "train.steps"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_fingerprint_tracks_model_shape_only():
    a = config_from_dict({})
    b = config_from_dict({"train": {"steps": 99}})
    c = config_from_dict({"model": {"dim": 64}})
    assert a.model_fingerprint() == b.model_fingerprint() != c.model_fingerprint()


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_launch_rejects_bad_config_before_any_worker_starts(tmp_path):
    run_dir = tmp_path / "run"
    r = _cli("launch", "configs/demo-cpu.toml", "--set", f"run.dir={run_dir}", "--set", "train.micro_batch_size=0")
    assert r.returncode == 2
    assert "train.micro_batch_size" in r.stderr
    assert not run_dir.exists(), "nothing may be written before the config is valid"
    r = _cli(
        "launch",
        "configs/demo-cpu.toml",
        "--set",
        f"run.dir={run_dir}",
        "--set",
        "train.global_batch_size=3",
        "--set",
        "train.micro_batch_size=1",
        "--nproc-per-node",
        "4",
    )
    assert r.returncode == 2 and "train.global_batch_size" in r.stderr and "4 ranks" in r.stderr
    r = _cli(
        "launch", "configs/demo-cpu.toml", "--set", f"run.dir={run_dir}", "--set", f"data.path={tmp_path}/missing.bin"
    )
    assert r.returncode == 2 and "data.path" in r.stderr
    assert not run_dir.exists()


def test_preflight_refuses_a_local_dir_it_cannot_write(tmp_path):
    from elastic_trainer.preflight import preflight

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = config_from_dict({"checkpoint": {"dir": str(tmp_path / "ckpt"), "local_dir": str(blocker / "local")}})
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert e.value.key == "checkpoint.local_dir" and str(blocker) in str(e.value)
    ok = config_from_dict({"checkpoint": {"dir": str(tmp_path / "ckpt"), "local_dir": str(tmp_path / "local")}})
    assert preflight(ok) is None and (tmp_path / "local").is_dir()


def test_launch_and_run_refuse_a_run_dir_they_cannot_write_before_any_worker_starts(tmp_path, token_file):
    """run.dir holds the event log and the preemption marker: one that cannot be a directory is
    named with exit 2 before anything starts (was a traceback from the supervisor)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    sets = ["--set", f"run.dir={blocker / 'run'}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    sets += ["--set", f"data.path={token_file}"]  # every other setting valid: the demo's token file may not exist yet
    for args in (
        ["launch", "configs/demo-cpu.toml", *sets],
        ["run", "--config", "configs/demo-cpu.toml", *sets, str(tmp_path / "train.py")],
    ):
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert "run.dir" in r.stderr and "cannot write to" in r.stderr and "Traceback" not in r.stderr, r.stderr
