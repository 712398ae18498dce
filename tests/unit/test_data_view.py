"""The frozen data view (pure checks and the worker's opening of a recorded view) and the bad-input
checks of token files: full-range vocabulary scan (cached), empty files, unique temp names."""

import os

import numpy as np
import pytest

from elastic_trainer import data_view
from elastic_trainer.config import config_from_dict
from elastic_trainer.errors import ConfigError
from elastic_trainer.worker import sources
from elastic_trainer.worker import tokens as tokens_mod
from elastic_trainer.worker.tokens import TokenFile, scan_max, unique_tmp

A = {"path": "/d/a.bin", "size": 10, "id": "x1"}
B = {"path": "/d/b.bin", "size": 20, "id": "x2"}


@pytest.mark.parametrize(
    "current, problems",
    [
        ([A, B], []),
        ([B, A, {"path": "/d/c.bin", "size": 5, "id": "x3"}], []),  # added files are no problem
        ([B], ["/d/a.bin is gone"]),
        ([{**A, "size": 11}, B], ["/d/a.bin changed: 10 bytes at the run's first start, 11 now"]),
        ([A, {**B, "id": "zz"}], ["/d/b.bin changed: same size, different content"]),
        ([], ["/d/a.bin is gone", "/d/b.bin is gone"]),
    ],
    ids=["same", "added", "vanished", "grew", "rewritten", "all-gone"],
)
def test_check_data_view(current, problems):
    got = data_view.check_data_view([A, B], current)
    assert len(got) == len(problems)
    for line, expected in zip(got, problems, strict=True):
        assert line.startswith(expected), (line, expected)


def test_added_files_keeps_the_current_order():
    assert data_view.added_files([A], ["/d/0.bin", "/d/a.bin", "/d/c.bin"]) == ["/d/0.bin", "/d/c.bin"]


def test_identity_sees_size_head_and_tail_changes(tmp_path):
    p = tmp_path / "f.bin"
    body = bytearray(os.urandom(300_000))
    p.write_bytes(bytes(body))
    first = data_view.describe(str(p))
    assert first == data_view.describe(str(p)) and first["size"] == 300_000
    for offset in (0, len(body) - 1):
        changed = bytearray(body)
        changed[offset] ^= 1
        p.write_bytes(bytes(changed))
        assert data_view.describe(str(p))["id"] != first["id"]
    p.write_bytes(bytes(body) + b"x")
    assert data_view.describe(str(p))["size"] == 300_001
    assert data_view.describe(str(tmp_path / "missing")) is None


def test_encode_decode_round_trip_and_refuses_other_json():
    assert data_view.decode(data_view.encode([A, B])) == [A, B]
    with pytest.raises(ValueError):
        data_view.decode('{"path": "x"}')


def _cfg(tmp_path, path, **data):
    return config_from_dict({"run": {"dir": str(tmp_path / "run")}, "data": {"path": str(path), **data}})


def test_a_recorded_view_is_read_whatever_the_directory_holds_now(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (np.arange(5000) % 256).astype(np.uint16).tofile(d / "only.bin")
    cfg = _cfg(tmp_path, d / "only.bin")
    source, view, added = sources.open_data_view(cfg, None)
    assert [e["path"] for e in view] == [str(d / "only.bin")] and added == []
    # The config now names another file: a resume still reads the recorded one.
    (np.arange(9000) % 256).astype(np.uint16).tofile(d / "other.bin")
    source2, view2, added2 = sources.open_data_view(_cfg(tmp_path, d / "other.bin"), view)
    assert view2 == view and added2 == [str(d / "other.bin")] and source2.n_samples == source.n_samples
    (d / "only.bin").write_bytes((d / "only.bin").read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"config error at 'data\.path'.*only\.bin changed: 10000 bytes"):
        sources.open_data_view(cfg, view)


def test_full_range_vocab_scan_finds_a_late_bad_id_and_names_its_position():
    tokens = np.zeros(1000, dtype=np.uint16)
    tokens[977] = 300
    with pytest.raises(ConfigError, match=r"model\.vocab_size.*token id 300 at token 977 of f\.bin"):
        scan_max(tokens, 256, "f.bin", chunk=64)
    assert scan_max(tokens, 512, "f.bin", chunk=64) == 300


def test_memmap_scan_is_cached_per_file_identity(tmp_path, monkeypatch):
    p = tmp_path / "t.bin"
    (np.arange(5000) % 200).astype(np.uint16).tofile(p)
    cfg = _cfg(tmp_path, p)
    assert sources.open_source(cfg).max_id == 199
    calls = []
    monkeypatch.setattr(tokens_mod, "scan_max", lambda *a, **k: calls.append(a) or 0)
    assert sources.open_source(cfg).max_id == 199 and calls == [], "a restart scanned the file again"
    (np.arange(5000) % 250).astype(np.uint16).tofile(p)  # rewritten: size the same, mtime not
    os.utime(p, ns=(1, 1))
    sources.open_source(cfg)
    assert len(calls) == 1


def test_an_empty_token_file_is_a_config_error_naming_data_path(tmp_path):
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"config error at 'data\.path': .*e\.bin is empty"):
        TokenFile(str(tmp_path / "e.bin"), "uint16", 8, 256)


def test_temp_names_differ_between_processes_and_calls():
    names = {unique_tmp("/cache/x.bin") for _ in range(100)}
    assert len(names) == 100
    host = os.uname().nodename
    assert all(n.startswith(f"/cache/x.bin.tmp.{host}.{os.getpid()}.") for n in names)


@pytest.mark.parametrize(
    "model",
    [
        {"dropout": 1.0},
        {"dropout": -0.1},
        {"dropout": 0.1, "factory": "elastic_trainer.models.hf:causal_lm", "hf_config": "x"},
    ],
    ids=["one", "negative", "with-hf"],
)
def test_model_dropout_is_checked_naming_the_key(model):
    with pytest.raises(ConfigError, match=r"config error at 'model\.dropout'"):
        config_from_dict({"model": model})


def test_demo_dropout_changes_training_outputs_only_in_training_mode():
    import torch

    from elastic_trainer.config import ModelConfig
    from elastic_trainer.worker.model import GPT

    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=32, seq_len=8, dim=16, n_layers=1, n_heads=2, mlp_ratio=2, dropout=0.5))
    x = torch.randint(0, 32, (2, 8))
    assert not torch.equal(m(x), m(x))
    m.eval()
    assert torch.equal(m(x), m(x))
