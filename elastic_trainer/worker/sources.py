"""Data sources: every ``data.format`` ends up as one flat token stream (a :class:`TokenFile`).

* ``memmap`` — ``data.path`` already is that stream.
* ``text`` — Parquet / Arrow (IPC file or stream) / JSONL files, read with pyarrow; column
  ``data.column`` (default ``text``) is tokenised with a local ``tokenizers`` tokenizer
  (``tokenizer.json``, or a directory holding it); ``data.eos_token`` (default: the
  ``eos_token`` of a ``tokenizer_config.json`` next to it, if any) is appended to every document.
* ``tokens`` — the same files with a column of token-id lists (default ``input_ids``).

Packing: documents are concatenated in file order (files sorted by path, rows in file order)
into one stream, and sample ``i`` is the window ``[i*L, i*L + L + 1)`` of it, exactly as for
a memmap. So the global sample cursor, the constant global batch and exact resume across
world sizes (:mod:`elastic_trainer.worker.data`) hold for every source unchanged: they only
see a TokenFile.

The stream is built once and cached at ``<data.cache_dir>/<format>-<key>.bin`` (default
``cache_dir``: ``<run.dir>/data-cache``), keyed by the files (path, size, mtime), the column,
the tokenizer's bytes and the EOS token. The supervisor builds it before any worker starts
(:func:`elastic_trainer.data_check.check_data_source`); a worker that finds it missing builds
it itself (atomic rename, so concurrent builders are harmless: they write identical bytes).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from typing import Iterator

import numpy as np

from ..config import Config, DataConfig
from ..errors import ConfigError
from .data import TokenFile

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
_KINDS = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow", ".jsonl": "json", ".json": "json", ".ndjson": "json"}
DEFAULT_COLUMN = {"text": "text", "tokens": "input_ids"}


def column_of(d: DataConfig) -> str:
    return d.column or DEFAULT_COLUMN[d.format]


def resolve_files(path: str, key: str = "data.path") -> list[str]:
    """A file, every supported file under a directory (recursively), or a glob; sorted."""
    if os.path.isdir(path):
        found = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if os.path.splitext(f)[1].lower() in _KINDS]
    elif any(c in path for c in "*?["):
        found = [p for p in glob.glob(path, recursive=True) if os.path.isfile(p)]
    elif os.path.isfile(path):
        found = [path]
    else:
        raise ConfigError(key, f"no such file or directory: {path}")
    if not found:
        raise ConfigError(key, f"no Parquet/Arrow/JSONL files at {path} (extensions: {', '.join(sorted(_KINDS))})")
    for f in found:
        if os.path.splitext(f)[1].lower() not in _KINDS:
            raise ConfigError(key, f"{f}: unsupported file type (expected one of {', '.join(sorted(_KINDS))})")
    return sorted(os.path.abspath(f) for f in found)


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ConfigError("data.format", "text/tokens sources need pyarrow: pip install 'elastic-trainer[hf]'") from None
    import pyarrow as pa

    return pa


def iter_column(files: list[str], column: str, batch_rows: int = 4096) -> Iterator:
    """Arrays of ``column``, file by file, in row order (pyarrow readers, no hand parsing)."""
    pa = _pyarrow()
    for f in files:
        kind = _KINDS[os.path.splitext(f)[1].lower()]
        try:
            if kind == "parquet":
                import pyarrow.parquet as pq

                pf = pq.ParquetFile(f)
                _check_column(f, column, pf.schema_arrow.names)
                for batch in pf.iter_batches(columns=[column], batch_size=batch_rows, use_threads=False):
                    yield batch.column(0)
            elif kind == "arrow":
                try:
                    reader = pa.ipc.open_file(f)
                    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                except pa.ArrowInvalid:
                    reader = pa.ipc.open_stream(f)  # e.g. files written by datasets' save_to_disk
                    batches = iter(reader)
                _check_column(f, column, reader.schema.names)
                for batch in batches:
                    yield batch.column(batch.schema.get_field_index(column))
            else:
                import pyarrow.json as pj

                table = pj.read_json(f)
                _check_column(f, column, table.column_names)
                for chunk in table.column(column).chunks:
                    yield chunk
        except ConfigError:
            raise
        except (pa.ArrowException, OSError) as e:
            raise ConfigError("data.path", f"cannot read {f}: {type(e).__name__}: {e}") from None


def _check_column(path: str, column: str, names: list[str]) -> None:
    if column not in names:
        raise ConfigError("data.column", f"{path} has no column {column!r} (columns: {', '.join(names)})")


def tokenizer_file(path: str, key: str = "data.tokenizer") -> str:
    p = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(p):
        raise ConfigError(key, f"no such tokenizer file: {p} (give a local tokenizer.json or its directory)")
    return p


def load_tokenizer(path: str, key: str = "data.tokenizer"):
    """A ``tokenizers.Tokenizer`` from a local file (the fast-tokenizer format transformers saves)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(key, "text sources need tokenizers: pip install 'elastic-trainer[hf]'") from None
    p = tokenizer_file(path, key)
    try:
        return Tokenizer.from_file(p)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
        raise ConfigError(key, f"cannot load {p}: {e}") from None


def eos_token(d: DataConfig) -> str:
    """``data.eos_token``, else the ``eos_token`` of ``tokenizer_config.json`` beside the tokenizer, else ''."""
    if d.eos_token:
        return d.eos_token
    cfg_path = os.path.join(os.path.dirname(tokenizer_file(d.tokenizer)), "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            tok = json.load(f).get("eos_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str):
            return tok
    return ""


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


def cache_path(cfg: Config) -> str:
    """Where the packed stream of ``cfg.data`` lives; the name changes with anything that
    changes its content."""
    d = cfg.data
    files = resolve_files(d.path)
    ident = {
        "version": CACHE_VERSION,
        "format": d.format,
        "column": column_of(d),
        "dtype": token_dtype(cfg.model.vocab_size),
        "files": [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files],
    }
    if d.format == "text":
        with open(tokenizer_file(d.tokenizer), "rb") as f:
            ident["tokenizer_sha256"] = hashlib.sha256(f.read()).hexdigest()
        ident["eos_token"] = eos_token(d)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    root = d.cache_dir or os.path.join(cfg.run.dir, "data-cache")
    return os.path.join(root, f"{d.format}-{key}.bin")


def check_tokenizer(cfg: Config):
    """The tokenizer of ``data.tokenizer``, refused (naming the key) if it has more tokens than
    the model's vocabulary."""
    d, vocab = cfg.data, cfg.model.vocab_size
    tok = load_tokenizer(d.tokenizer)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab:
        raise ConfigError("data.tokenizer", f"{tokenizer_file(d.tokenizer)} has {n} tokens but model.vocab_size is {vocab}: the tokenizer does not fit the model")
    return tok


def _token_chunks(cfg: Config) -> Iterator[np.ndarray]:
    d, vocab = cfg.data, cfg.model.vocab_size
    files = resolve_files(d.path)
    column = column_of(d)
    if d.format == "tokens":
        import pyarrow.compute as pc

        for arr in iter_column(files, column):
            if not (hasattr(arr.type, "value_type") and str(arr.type.value_type).startswith(("int", "uint"))):
                raise ConfigError("data.column", f"column {column!r} holds {arr.type}, not lists of token ids")
            values = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
            if values.size and (values.min() < 0 or values.max() >= vocab):
                bad = int(values.max()) if values.max() >= vocab else int(values.min())
                raise ConfigError("model.vocab_size", f"token id {bad} in {d.path} is outside [0, model.vocab_size={vocab})")
            yield values.astype(np.int64)
        return
    tok = check_tokenizer(cfg)
    eos = eos_token(d)
    eos_id = None
    if eos:
        eos_id = tok.token_to_id(eos)
        if eos_id is None:
            raise ConfigError("data.eos_token", f"{eos!r} is not a token of {tokenizer_file(d.tokenizer)}")
    for arr in iter_column(files, column):
        if str(arr.type) not in ("string", "large_string"):
            raise ConfigError("data.column", f"column {column!r} holds {arr.type}, not text")
        texts = [t for t in arr.to_pylist() if t]
        if not texts:
            continue
        ids: list[int] = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            if eos_id is not None:
                ids.append(eos_id)
        yield np.asarray(ids, dtype=np.int64)


def build_stream(cfg: Config, out_path: str) -> dict:
    """Tokenise/pack ``cfg.data`` into ``out_path`` (atomic). Returns stats."""
    dtype = token_dtype(cfg.model.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = f"{out_path}.tmp.{os.getpid()}"
    total, max_id = 0, -1
    try:
        with open(tmp, "wb") as f:
            for chunk in _token_chunks(cfg):
                f.write(chunk.astype(dtype).tobytes())
                total += len(chunk)
                if len(chunk):
                    max_id = max(max_id, int(chunk.max()))
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    stats = {"path": out_path, "tokens": total, "max_id": max_id, "dtype": dtype, "format": cfg.data.format, "source": cfg.data.path}
    with open(out_path + ".json.tmp", "w") as f:
        json.dump(stats, f)
    os.replace(out_path + ".json.tmp", out_path + ".json")
    logger.info("packed %s (%s) into %d tokens at %s", cfg.data.path, cfg.data.format, total, out_path)
    return stats


def prepare(cfg: Config) -> tuple[str, str]:
    """``(path, dtype)`` of the token stream for ``cfg.data``, building the cache if needed."""
    d = cfg.data
    if d.format == "memmap":
        return d.path, d.dtype
    path = cache_path(cfg)
    if d.format == "text":
        check_tokenizer(cfg)  # also when cached: the key does not cover model.vocab_size
    if not os.path.exists(path) or not os.path.exists(path + ".json"):
        build_stream(cfg, path)
    with open(path + ".json") as f:
        max_id = json.load(f).get("max_id", -1)
    if max_id >= cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", f"token id {max_id} in the stream of {d.path} is >= model.vocab_size={cfg.model.vocab_size}")
    return path, token_dtype(cfg.model.vocab_size)


def open_source(cfg: Config) -> TokenFile:
    """The :class:`TokenFile` every data format resolves to."""
    path, dtype = prepare(cfg)
    return TokenFile(path, dtype, cfg.model.seq_len, cfg.model.vocab_size)
