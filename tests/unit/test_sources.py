"""Data sources (no process group): Parquet/Arrow/JSONL text and token-list files packed into
one token stream, its cache, its errors, and world-size invariance of the batches over it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from elastic_trainer.config import config_from_dict
from elastic_trainer.errors import ConfigError
from elastic_trainer.worker import sources
from elastic_trainer.worker.data import IGNORE_INDEX, StepBatches

pa = pytest.importorskip("pyarrow")
pytest.importorskip("tokenizers")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = [
    f"document {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][j % 4] for j in range(i % 7 + 1))
    for i in range(60)
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return str(d / "tokenizer.json")


def cfg(tmp_path, path, tokenizer="", vocab=512, **data):
    d = {"path": str(path), **data}
    if tokenizer:
        d.setdefault("format", "text")
        d["tokenizer"] = tokenizer
    return config_from_dict(
        {"run": {"dir": str(tmp_path / "run")}, "model": {"vocab_size": vocab, "seq_len": 8}, "data": d}
    )


def expected_stream(tokenizer: str, docs: list[str], eos: str = "<eos>") -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    ids = []
    for doc in docs:
        ids += tok.encode(doc, add_special_tokens=False).ids + [tok.token_to_id(eos)]
    return np.asarray(ids)


def stream_of(c) -> np.ndarray:
    return np.asarray(sources.open_source(c).tokens).astype(np.int64)


def test_parquet_text_is_tokenised_and_packed_in_file_and_row_order(tmp_path, tokenizer):
    d = tmp_path / "data"
    d.mkdir()
    pq.write_table(pa.table({"text": DOCS[30:]}), d / "b.parquet", row_group_size=7)
    pq.write_table(pa.table({"text": DOCS[:30], "other": list(range(30))}), d / "a.parquet", row_group_size=4)
    c = cfg(tmp_path, d, tokenizer, eos_token="<eos>")
    np.testing.assert_array_equal(stream_of(c), expected_stream(tokenizer, DOCS))
    assert sources.prepare(c)[1] == "uint16"


def test_jsonl_and_arrow_give_the_same_stream_as_parquet(tmp_path, tokenizer):
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "x.parquet")
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(DOCS)))
    table = pa.table({"text": DOCS})
    with pa.ipc.new_file(str(tmp_path / "file.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=9)
    with pa.ipc.new_stream(str(tmp_path / "stream.arrow"), table.schema) as w:  # the layout datasets writes
        w.write_table(table, max_chunksize=11)
    streams = [
        stream_of(cfg(tmp_path, tmp_path / n, tokenizer, eos_token="<eos>"))
        for n in ("x.parquet", "x.jsonl", "file.arrow", "stream.arrow")
    ]
    for s in streams[1:]:
        np.testing.assert_array_equal(s, streams[0])


def test_eos_token_defaults_to_tokenizer_config(tmp_path, tokenizer):
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "x.parquet")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes(open(tokenizer, "rb").read())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    np.testing.assert_array_equal(
        stream_of(cfg(tmp_path, tmp_path / "x.parquet", str(tok_dir))), expected_stream(tokenizer, DOCS)
    )


def test_token_lists(tmp_path):
    rows = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), tmp_path / "t.parquet")
    c = cfg(tmp_path, tmp_path / "t.parquet", format="tokens")
    np.testing.assert_array_equal(stream_of(c), np.concatenate(rows))
    with pytest.raises(ConfigError) as e:
        stream_of(cfg(tmp_path, tmp_path / "t.parquet", format="tokens", vocab=10))
    assert e.value.key == "model.vocab_size"


def test_cache_is_reused_and_keyed_by_content(tmp_path, tokenizer):
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "x.parquet")
    c = cfg(tmp_path, tmp_path / "x.parquet", tokenizer, eos_token="<eos>")
    path, _, _ = sources.prepare(c)
    assert path.startswith(str(tmp_path / "run" / "data-cache"))
    before = os.stat(path).st_mtime_ns
    assert sources.prepare(c)[0] == path and os.stat(path).st_mtime_ns == before
    assert sources.cache_path(cfg(tmp_path, tmp_path / "x.parquet", tokenizer)) != path  # no EOS: other stream
    pq.write_table(pa.table({"text": DOCS[:10]}), tmp_path / "x.parquet")
    assert sources.cache_path(c) != path


def test_vocab_checks_hold_when_the_stream_is_cached(tmp_path, tokenizer):
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "x.parquet")
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2, 30]], pa.list_(pa.int32()))}), tmp_path / "t.parquet")
    shared = {"cache_dir": str(tmp_path / "cache")}
    sources.prepare(cfg(tmp_path, tmp_path / "x.parquet", tokenizer, **shared))
    sources.prepare(cfg(tmp_path, tmp_path / "t.parquet", format="tokens", **shared))
    with pytest.raises(ConfigError) as e:
        sources.prepare(cfg(tmp_path, tmp_path / "x.parquet", tokenizer, vocab=8, **shared))
    assert e.value.key == "data.tokenizer"
    with pytest.raises(ConfigError) as e:
        sources.prepare(cfg(tmp_path, tmp_path / "t.parquet", format="tokens", vocab=20, **shared))
    assert e.value.key == "model.vocab_size"


@pytest.mark.parametrize(
    "setup, key",
    [
        (lambda t, tok: cfg(t, t / "x.parquet", tok, vocab=8), "data.tokenizer"),
        (lambda t, tok: cfg(t, t / "x.parquet", tok, column="body"), "data.column"),
        (lambda t, tok: cfg(t, t / "x.parquet", tok, eos_token="</s>"), "data.eos_token"),
        (lambda t, tok: cfg(t, t / "nothing-here", tok), "data.path"),
        (lambda t, tok: cfg(t, t / "x.csv", tok), "data.path"),
        (lambda t, tok: cfg(t, t / "x.parquet", str(t / "no-tokenizer.json")), "data.tokenizer"),
        (lambda t, tok: cfg(t, t / "x.parquet", format="tokens"), "data.column"),
    ],
    ids=[
        "tokenizer-larger-than-vocab",
        "missing-column",
        "eos-not-in-vocab",
        "no-files",
        "unsupported-type",
        "missing-tokenizer",
        "text-as-tokens",
    ],
)
def test_errors_name_the_key(tmp_path, tokenizer, setup, key):
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "x.parquet")
    (tmp_path / "x.csv").write_text("text\nhello\n")
    with pytest.raises(ConfigError) as e:
        sources.open_source(setup(tmp_path, tokenizer))
    assert e.value.key == key, str(e.value)


@pytest.mark.parametrize(
    "data, key",
    [
        ({"format": "text"}, "data.tokenizer"),
        ({"tokenizer": "tok.json"}, "data.tokenizer"),
        ({"format": "csv"}, "data.format"),
        ({"eos_token": "<eos>"}, "data.eos_token"),
    ],
)
def test_config_validation(data, key):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"data": {"path": "x", **data}})
    assert e.value.key == key


def test_batches_over_a_text_source_do_not_depend_on_world_size(tmp_path, tokenizer):
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "x.parquet")
    source = sources.open_source(cfg(tmp_path, tmp_path / "x.parquet", tokenizer, eos_token="<eos>"))

    def global_step(world: int, cursor: int) -> np.ndarray:
        rows = []
        for rank in range(world):
            batches = StepBatches(source, seed=3, global_batch=7, micro_batch=2, world=world, rank=rank)
            for mb in (batches.fetch(m) for m in batches.sampler.at(cursor)):
                if mb.n_samples:
                    rows.append(np.concatenate([mb.inputs.numpy(), mb.targets.numpy()], axis=1))
                else:
                    assert (mb.targets == IGNORE_INDEX).all()
        return np.concatenate(rows)

    for cursor in (0, 7, 14, 7 * 40):  # the last one wraps into a later epoch
        ref = global_step(1, cursor)
        for world in (2, 3, 4):
            np.testing.assert_array_equal(global_step(world, cursor), ref)
