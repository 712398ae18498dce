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
it itself (atomic rename from a temporary name unique to host, process and call, so
concurrent builders on nodes sharing the cache directory are harmless: they write identical bytes).

The file list is resolved once per run: the first start records it (:mod:`elastic_trainer.data_view`)
and every resume reads exactly that list (:func:`open_data_view`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Iterator

import numpy as np

from .. import data_view
from ..config import Config, DataConfig
from ..errors import ConfigError
from .tokens import TokenFile, unique_tmp

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
_KINDS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
}
DEFAULT_COLUMN = {"text": "text", "tokens": "input_ids"}


def column_of(d: DataConfig) -> str:
    return d.column or DEFAULT_COLUMN[d.format]


def resolve_files(path: str, key: str = "data.path") -> list[str]:
    """A file, every supported file under a directory (recursively), or a glob; sorted."""
    if os.path.isdir(path):
        found = [
            os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if os.path.splitext(f)[1].lower() in _KINDS
        ]
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
        import pyarrow  # noqa: F401 - only whether it imports
    except ImportError:
        raise ConfigError(
            "data.format",
            "text/tokens sources need pyarrow: install the hf extra: "
            "pip install -e '.[hf]' in the elastic-trainer clone",
        ) from None
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
                yield from table.column(column).chunks
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
        raise ConfigError(
            key,
            "text sources need tokenizers: install the hf extra: pip install -e '.[hf]' in the elastic-trainer clone",
        ) from None
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


def cache_root(cfg: Config) -> str:
    return cfg.data.cache_dir or os.path.join(cfg.run.dir, "data-cache")


def cache_path(cfg: Config, files: list[str] | None = None) -> str:
    """Where the packed stream of ``cfg.data`` (of ``files``, default: resolved from
    ``data.path`` now) lives; the name changes with anything that changes its content."""
    d = cfg.data
    files = resolve_files(d.path) if files is None else files
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
    return os.path.join(cache_root(cfg), f"{d.format}-{key}.bin")


def check_tokenizer(cfg: Config):
    """The tokenizer of ``data.tokenizer``, refused (naming the key) if it has more tokens than
    the model's vocabulary."""
    d, vocab = cfg.data, cfg.model.vocab_size
    tok = load_tokenizer(d.tokenizer)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab:
        raise ConfigError(
            "data.tokenizer",
            f"{tokenizer_file(d.tokenizer)} has {n} tokens but "
            f"model.vocab_size is {vocab}: the tokenizer does not fit the model",
        )
    return tok


def _token_chunks(cfg: Config, files: list[str]) -> Iterator[np.ndarray]:
    d, vocab = cfg.data, cfg.model.vocab_size
    column = column_of(d)
    if d.format == "tokens":
        import pyarrow.compute as pc

        for arr in iter_column(files, column):
            if not (hasattr(arr.type, "value_type") and str(arr.type.value_type).startswith(("int", "uint"))):
                raise ConfigError("data.column", f"column {column!r} holds {arr.type}, not lists of token ids")
            values = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
            if values.size and (values.min() < 0 or values.max() >= vocab):
                bad = int(values.max()) if values.max() >= vocab else int(values.min())
                raise ConfigError(
                    "model.vocab_size", f"token id {bad} in {d.path} is outside [0, model.vocab_size={vocab})"
                )
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


def build_stream(cfg: Config, out_path: str, files: list[str] | None = None) -> dict:
    """Tokenise/pack ``cfg.data`` (``files``, default: resolved now) into ``out_path`` (atomic). Returns stats."""
    dtype = token_dtype(cfg.model.vocab_size)
    files = resolve_files(cfg.data.path) if files is None else files
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = unique_tmp(out_path)
    total, max_id = 0, -1
    try:
        with open(tmp, "wb") as f:
            for chunk in _token_chunks(cfg, files):
                f.write(chunk.astype(dtype).tobytes())
                total += len(chunk)
                if len(chunk):
                    max_id = max(max_id, int(chunk.max()))
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    stats = {
        "path": out_path,
        "tokens": total,
        "max_id": max_id,
        "dtype": dtype,
        "format": cfg.data.format,
        "source": cfg.data.path,
    }
    _write_json_atomic(out_path + ".json", stats)
    logger.info("packed %s (%s) into %d tokens at %s", cfg.data.path, cfg.data.format, total, out_path)
    return stats


def _write_json_atomic(path: str, obj: dict) -> None:
    tmp = unique_tmp(path)
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def prepare(cfg: Config, files: list[str] | None = None) -> tuple[str, str, int | None]:
    """``(path, dtype, max_id)`` of the token stream for ``cfg.data`` (of ``files``, default:
    resolved from ``data.path`` now), building the cache if needed. ``max_id`` is None when
    not known yet (a memmap scanned for the first time)."""
    d = cfg.data
    if d.format == "memmap":
        path = files[0] if files else d.path
        return path, d.dtype, _cached_memmap_max(cfg, path)
    path = cache_path(cfg, files)
    if d.format == "text":
        check_tokenizer(cfg)  # also when cached: the key does not cover model.vocab_size
    if not os.path.exists(path) or not os.path.exists(path + ".json"):
        build_stream(cfg, path, files)
    with open(path + ".json") as f:
        max_id = json.load(f).get("max_id", -1)
    if max_id >= cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"token id {max_id} in the stream of {d.path} is >= model.vocab_size={cfg.model.vocab_size}",
        )
    return path, token_dtype(cfg.model.vocab_size), max_id


def _memmap_max_path(cfg: Config, path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    ident = json.dumps([os.path.abspath(path), st.st_size, st.st_mtime_ns, cfg.data.dtype])
    return os.path.join(cache_root(cfg), f"memmap-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.max.json")


def _cached_memmap_max(cfg: Config, path: str) -> int | None:
    p = _memmap_max_path(cfg, path)
    try:
        with open(p) as f:  # type: ignore[arg-type]
            return int(json.load(f)["max_id"])
    except (OSError, TypeError, ValueError, KeyError):
        return None


def _remember_memmap_max(cfg: Config, path: str, max_id: int) -> None:
    """Cache the full-range scan of a memmap, keyed by (path, size, mtime, dtype), so a restart
    does not read the whole file again. Best effort (the cache directory may be read-only)."""
    p = _memmap_max_path(cfg, path)
    if p is None:
        return
    try:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        _write_json_atomic(p, {"max_id": max_id, "path": os.path.abspath(path)})
    except OSError as e:
        logger.debug("cannot cache the token scan of %s: %s", path, e)


def open_source(cfg: Config, files: list[str] | None = None) -> TokenFile:
    """The :class:`TokenFile` every data format resolves to: of ``files`` (a data view's paths)
    or, by default, of whatever ``data.path`` resolves to now."""
    path, dtype, max_id = prepare(cfg, files)
    source = TokenFile(path, dtype, cfg.model.seq_len, cfg.model.vocab_size, max_id=max_id)
    if max_id is None and cfg.data.format == "memmap":
        _remember_memmap_max(cfg, path, source.max_id)
    return source


# ---------------------------------------------------------------- the frozen data view


def view_paths(cfg: Config) -> list[str]:
    """The files ``data.path`` names now (absolute, in read order)."""
    d = cfg.data
    if d.format == "memmap":
        if not os.path.isfile(d.path):
            raise ConfigError(
                "data.path", f"no such token file: {d.path} (build one with 'elastic-trainer data build')"
            )
        return [os.path.abspath(d.path)]
    return resolve_files(d.path)


def current_view(cfg: Config) -> list[dict]:
    """The data view a fresh run records: the files ``data.path`` resolves to now."""
    paths = view_paths(cfg)
    view = data_view.describe_all(paths)
    if len(view) != len(paths):
        gone = sorted(set(paths) - {e["path"] for e in view})
        raise ConfigError("data.path", f"cannot read {gone[0]}")
    return view


def check_recorded_view(cfg: Config, recorded: list[dict]) -> list[str]:
    """Raise ConfigError (``data.path``) naming every recorded file that vanished or changed;
    return the files ``data.path`` resolves to now that the recorded view does not read
    (they are ignored)."""
    problems = data_view.check_data_view(recorded, data_view.describe_all([e["path"] for e in recorded]))
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError(
            "data.path",
            "the files this run has read since its first start are not all there unchanged: "
            + "; ".join(problems[:3])
            + more
            + '. Restore them, or start a new run (another checkpoint.dir, or checkpoint.resume = "none")',
        )
    try:
        now = view_paths(cfg)
    except ConfigError:
        now = []
    return data_view.added_files(recorded, now)


def open_data_view(
    cfg: Config, recorded: list[dict] | None, rank: int = 0, group=None
) -> tuple[TokenFile, list[dict], list[str]]:
    """``(source, view, added)``: the token stream of the run's data view. A resume reads
    exactly the ``recorded`` view; a fresh start records what rank 0 resolves now (broadcast
    over ``group`` when given, so nodes that start at different times agree). Every rank checks
    that it sees the view's files unchanged. ``added``: files ignored because the view is frozen.
    All ranks (collective when ``group`` is given and ``recorded`` is None)."""
    if recorded is None:
        view: list[dict] | tuple[str, str] | None = None
        if rank == 0:
            try:
                view = current_view(cfg)
            except ConfigError as e:  # every rank raises it; none waits for a broadcast that never comes
                view = (e.key, str(e).removeprefix(f"config error at '{e.key}': "))
        if group is not None:
            import torch.distributed as dist

            box = [view]
            dist.broadcast_object_list(box, src=0, group=group)
            view = box[0]
        if isinstance(view, tuple):
            raise ConfigError(*view)
        assert view is not None  # rank 0's, or broadcast from it over group
        check_recorded_view(cfg, view)  # another node may see other files than rank 0
        added: list[str] = []
    else:
        view = recorded
        added = check_recorded_view(cfg, view)
    return open_source(cfg, [e["path"] for e in view]), view, added
