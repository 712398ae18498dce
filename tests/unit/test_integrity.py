"""Checksummed DCP writer / verifying reader (checkpoint/integrity.py), in one process, world 1.

A real ``dcp.save`` through the checksummed writer must list every item of every file with its
XXH3 in ``.checksums.json``; the verifying reader loads it back, and refuses a single flipped
byte anywhere in a shard, and a ``.metadata`` that does not match *before* unpickling it. The
checkpoint stays a plain DCP checkpoint (torch's own reader and ``format_utils`` read it). The
last tests fail loudly when torch changes the private APIs integrity.py relies on.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.utils.serialization import config as serialization_config

from elastic_trainer.checkpoint import integrity, layout
from elastic_trainer.errors import CheckpointIntegrityError


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(64, 16, generator=g), "b": torch.randn(16, generator=g), "n": torch.arange(10)},
        "train": {"step": 7, "skipped": [[10, 20]], "name": "x"},  # bytes items (pickled objects)
    }


def _empty_like(sd: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
        "train": {"step": 0, "skipped": [], "name": ""},
    }


def _save(path: Path, sd: dict | None = None, writer_cls=FileSystemWriter) -> dict:
    sd = sd or _state()
    writer = integrity.ChecksummedWriter(writer_cls(str(path)))
    dcp.save(sd, storage_writer=writer)
    return sd


def _table(path: Path) -> dict:
    return json.loads((path / layout.CHECKSUMS).read_text())["files"]


def _checks(path: Path) -> layout.Checks:
    return layout.Checks.from_manifest({"files": _table(path)})


def _raises_integrity(fn, match: str) -> str:
    """Run ``fn``; it must fail with a CheckpointIntegrityError whose message contains ``match``
    (inside DCP's CheckpointException, a BaseException, when raised under ``dcp.load``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn()
    except CheckpointIntegrityError as e:
        assert match in str(e), e
        return str(e)
    except CheckpointException as e:
        # DCP reports a rank's failure inside its own exception (wrapped, by message).
        assert match in repr(e), f"DCP failed, but not because of the check: {e!r}"
        return repr(e)
    raise AssertionError("expected a CheckpointIntegrityError, nothing was raised")


@pytest.fixture
def saved(tmp_path) -> tuple[Path, dict]:
    path = tmp_path / "ck"
    return path, _save(path)


def test_checksums_list_every_item_of_every_file_as_written(saved):
    path, _ = saved
    table = _table(path)
    on_disk = {p.name for p in path.iterdir()} - {layout.CHECKSUMS}
    assert set(table) == on_disk, "every file DCP wrote (shards and .metadata) is listed, nothing else"
    meta = (path / ".metadata").read_bytes()
    assert table[".metadata"] == {"size": len(meta), "xxh3": xxhash.xxh3_64_intdigest(meta)}
    shards = [n for n in table if n.endswith(".distcp")]
    assert shards
    n_items = 0
    for name in shards:
        data = (path / name).read_bytes()
        f = table[name]
        assert f["size"] == len(data) and f["xxh3"] == xxhash.xxh3_64_intdigest(data)
        # The items tile the file exactly: a flipped byte anywhere lands in a checked item.
        pos = 0
        for off, length, h in f["items"]:
            assert off == pos and length > 0
            assert h == xxhash.xxh3_64_intdigest(data[off : off + length])
            pos += length
        assert pos == len(data)
        n_items += len(f["items"])
    # Every item DCP's metadata points at is listed with exactly its (offset, length).
    md = pickle.loads(meta)  # noqa: S301 - our own file, just written
    listed = {(n, off, length) for n in shards for off, length, _ in table[n]["items"]}
    assert {(s.relative_path, s.offset, s.length) for s in md.storage_data.values()} == listed
    assert n_items == len(md.storage_data)
    # The coordinator stripped its checksums: .metadata is plain DCP metadata.
    assert all(type(s).__name__ == "_StorageInfo" for s in md.storage_data.values())


def test_verifying_reader_loads_it_back_exactly(saved):
    path, sd = saved
    out = _empty_like(sd)
    dcp.load(out, storage_reader=integrity.verifying(FileSystemReader(str(path)), _checks(path)))
    for k, v in sd["model"].items():
        assert torch.equal(out["model"][k], v), k
    assert out["train"] == sd["train"]


def test_a_reader_given_the_metadata_reads_only_the_shards_and_still_verifies_them(saved):
    """The resume's ranks load from the metadata the deciding rank read (verified there): none
    opens ``.metadata`` again, the shards are verified all the same, and the reader says how long
    its reads and their checksums took (the resume's timeline)."""
    path, sd = saved
    md = integrity.verifying(FileSystemReader(str(path)), _checks(path)).read_metadata()
    reader = integrity.verifying(FileSystemReader(str(path)), _checks(path), metadata=md)
    opened: list[str] = []
    create = reader.fs.create_stream

    def stream(p, mode):
        opened.append(os.path.basename(str(p)))
        return create(p, mode)

    reader.fs.create_stream = stream
    out = _empty_like(sd)
    integrity.load(out, reader, no_dist=True)
    assert opened and layout.METADATA not in opened, opened
    assert all(torch.equal(out["model"][k], v) for k, v in sd["model"].items()) and out["train"] == sd["train"]
    start, end = reader.read_span
    assert end >= start and 0 < reader.verify_seconds <= end - start
    shard = next(p for p in path.iterdir() if p.name.endswith(".distcp"))
    _flip(shard, 20)
    bad = integrity.verifying(FileSystemReader(str(path)), _checks(path), metadata=md)
    _raises_integrity(lambda: integrity.load(_empty_like(sd), bad, no_dist=True), "checksum mismatch")


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_flipped_byte_anywhere_in_a_shard_is_refused(saved):
    path, sd = saved
    (shard,) = [n for n in _table(path) if n.endswith(".distcp")]
    size = (path / shard).stat().st_size
    items = _table(path)[shard]["items"]
    # The first and last byte of every item, the middle of the file, and its last byte.
    offsets = sorted({o for off, length, _ in items for o in (off, off + length - 1)} | {size // 2, size - 1})
    pristine = (path / shard).read_bytes()
    for off in offsets:
        _flip(path / shard, off)
        assert (path / shard).stat().st_size == size
        _raises_integrity(
            lambda: dcp.load(
                _empty_like(sd), storage_reader=integrity.verifying(FileSystemReader(str(path)), _checks(path))
            ),
            "checksum mismatch (corrupted shard)",
        )
        (path / shard).write_bytes(pristine)
    # Sanity: restored, it loads again.
    dcp.load(_empty_like(sd), storage_reader=integrity.verifying(FileSystemReader(str(path)), _checks(path)))


def test_an_item_missing_from_the_manifest_is_refused(saved):
    path, sd = saved
    table = _table(path)
    (shard,) = [n for n in table if n.endswith(".distcp")]
    table[shard]["items"] = table[shard]["items"][1:]
    checks = layout.Checks.from_manifest({"files": table})
    _raises_integrity(
        lambda: dcp.load(_empty_like(sd), storage_reader=integrity.verifying(FileSystemReader(str(path)), checks)),
        "item not listed in the manifest",
    )


class _Boom:
    """Unpickling this runs ``os.system`` (what a forged ``.metadata`` could do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_is_verified_before_it_is_unpickled(saved, tmp_path):
    path, sd = saved
    checks = _checks(path)
    marker = tmp_path / "PWNED"
    evil = pickle.dumps(_Boom(marker))
    meta = path / ".metadata"
    # Same size as the real one (padded: pickle stops at STOP), so only the checksum can tell.
    real = meta.read_bytes()
    assert len(evil) < len(real)
    meta.write_bytes(evil + b"\0" * (len(real) - len(evil)))
    reader = integrity.verifying(FileSystemReader(str(path)), checks)
    _raises_integrity(reader.read_metadata, "refused before unpickling")
    _raises_integrity(
        lambda: integrity.load(_empty_like(sd), integrity.verifying(FileSystemReader(str(path)), checks)),
        "before unpickling",
    )
    assert not marker.exists(), "the forged .metadata was unpickled"
    # Another size: refused by size, also before unpickling.
    meta.write_bytes(evil)
    _raises_integrity(integrity.verifying(FileSystemReader(str(path)), checks).read_metadata, "the manifest says")
    assert not marker.exists()
    # The control: a reader without checks would have run it (so the test above can fail).
    with pytest.raises(Exception):  # noqa: B017 - whatever the padded pickle does after running
        FileSystemReader(str(path)).read_metadata()
    assert marker.exists()


def test_dcp_load_hides_a_refused_metadata_on_torch_2_11(saved):
    # integrity.load's reason: torch 2.11 catches read_metadata's error and reports only "metadata
    # is None"; 2.12 names it in that message, 2.13 raises it. A torch that changes this fails here.
    path, sd = saved
    (path / ".metadata").write_bytes(b"\0" * (path / ".metadata").stat().st_size)
    reader = integrity.verifying(FileSystemReader(str(path)), _checks(path))
    with pytest.raises(CheckpointException) as e:
        dcp.load(_empty_like(sd), storage_reader=reader)
    hidden = "metadata is None" in repr(e.value) and "refused before unpickling" not in repr(e.value)
    assert hidden == (torch.__version__ < "2.12"), repr(e.value)
    assert isinstance(reader.refused, CheckpointIntegrityError)


def test_plain_torch_reader_and_format_utils_still_read_it(saved, tmp_path):
    path, sd = saved
    out = _empty_like(sd)
    dcp.load(out, storage_reader=FileSystemReader(str(path)))
    assert all(torch.equal(out["model"][k], v) for k, v in sd["model"].items())
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = tmp_path / "full.pt"
    dcp_to_torch_save(str(path), str(dst))
    full = torch.load(dst, weights_only=False)
    assert all(torch.equal(full["model"][k], v) for k, v in sd["model"].items())
    assert full["train"]["skipped"] == [[10, 20]]


def test_fsspec_writer_and_reader_round_trip(tmp_path):
    """The fsspec variants (used for s3://) on fsspec's local file system."""
    from torch.distributed.checkpoint._fsspec_filesystem import (
        FsspecReader,
        FsspecWriter,
    )

    path = tmp_path / "ck"
    sd = _save(path, writer_cls=FsspecWriter)
    checks = _checks(path)
    assert checks.metadata is not None and checks.items
    out = _empty_like(sd)
    dcp.load(out, storage_reader=integrity.verifying(FsspecReader(str(path)), checks))
    assert all(torch.equal(out["model"][k], v) for k, v in sd["model"].items())
    (shard,) = [n for n in _table(path) if n.endswith(".distcp")]
    _flip(path / shard, (path / shard).stat().st_size // 2)
    _raises_integrity(
        lambda: dcp.load(_empty_like(sd), storage_reader=integrity.verifying(FsspecReader(str(path)), checks)),
        "checksum mismatch",
    )


def test_a_checksummed_writer_pickled_before_it_writes_still_checksums(tmp_path):
    """checkpoint.writer = "process": DCP pickles the writer to the writer process, which writes."""
    path = tmp_path / "ck"
    writer = pickle.loads(pickle.dumps(integrity.ChecksummedWriter(FileSystemWriter(str(path)))))  # noqa: S301 - our own bytes
    sd = _state()
    dcp.save(sd, storage_writer=writer)
    assert set(_table(path)) == {p.name for p in path.iterdir()} - {layout.CHECKSUMS}
    out = _empty_like(sd)
    dcp.load(out, storage_reader=integrity.verifying(FileSystemReader(str(path)), _checks(path)))
    assert all(torch.equal(out["model"][k], v) for k, v in sd["model"].items())


def test_the_crc32_switch_is_restored_after_a_save(tmp_path):
    before = torch.serialization.get_crc32_options()
    _save(tmp_path / "ck")
    assert torch.serialization.get_crc32_options() == before


# ------------------------------------------------------------------ torch's private APIs
def test_torch_private_apis_integrity_relies_on_still_exist():
    """Fails loudly when torch renames or reshapes what checkpoint/integrity.py uses (listed in
    its docstring). When this fails, fix integrity.py (and its docstring) before anything else."""
    from torch.distributed.checkpoint import _fsspec_filesystem, filesystem

    assert hasattr(_fsspec_filesystem, "FsspecWriter") and hasattr(_fsspec_filesystem, "FsspecReader")
    info = filesystem._StorageInfo
    assert {"relative_path", "offset", "length"} <= set(inspect.signature(info).parameters)
    for reader in (FileSystemReader, _fsspec_filesystem.FsspecReader):
        assert list(inspect.signature(reader._slice_file).parameters) == ["self", "file", "sinfo"], reader
        assert "rank" in inspect.signature(reader._get_metadata_path).parameters, reader
        assert hasattr(reader, "read_metadata")
    # The writers keep their file system in ``fs`` and their directory in ``path`` (ChecksummedWriter
    # wraps the one and writes .checksums.json into the other); set_up_storage_writer takes DCP's keywords
    # (ChecksummedWriter hands them on, and DCP passes them only to a signature with **kwargs).
    for writer in (FileSystemWriter, _fsspec_filesystem.FsspecWriter):
        w = writer("/nonexistent-but-unused")
        assert hasattr(w, "fs") and hasattr(w, "path"), writer
        assert "kwargs" in inspect.signature(w.set_up_storage_writer).parameters, writer
    assert hasattr(FileSystemReader("/nonexistent-but-unused"), "fs")
    # ``_write_item`` calls tell() around each item; write_data/finish keep their signatures.
    src = inspect.getsource(filesystem._write_item)
    assert "tell()" in src
    assert list(inspect.signature(FileSystemWriter.write_data).parameters)[:3] == ["self", "plan", "planner"]
    assert list(inspect.signature(FileSystemWriter.finish).parameters)[:3] == ["self", "metadata", "results"]
    # The coordinator writes ``.metadata`` through a ``.metadata.tmp`` stream.
    assert ".tmp" in inspect.getsource(FileSystemWriter.finish) or ".tmp" in inspect.getsource(filesystem)
    assert callable(torch.serialization.get_crc32_options) and callable(torch.serialization.set_crc32_options)
    # Raw copies: each item's storage info carries descriptors; narrow_tensor_by_index cuts a stored chunk.
    assert "transform_descriptors" in inspect.signature(info).parameters
    from torch.distributed._shard._utils import narrow_tensor_by_index

    assert list(inspect.signature(narrow_tensor_by_index).parameters) == ["tensor", "offsets", "sizes"]
    assert hasattr(FileSystemReader("/nonexistent-but-unused"), "storage_data") or "storage_data" in inspect.getsource(
        FileSystemReader.set_up_storage_reader
    )
    # The raw copier flattens a state as DCP's planner does (then plans with flattening off):
    # flatten_state_dict gives (flat, mappings); ShardedTensor is what the planner flattens further.
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mappings = flatten_state_dict({"a": {"b": torch.ones(1)}, "c": [1]})
    assert list(flat) == ["a.b", "c"] and set(mappings) == {"a.b", "c"}
    assert issubclass(ShardedTensor, torch.Tensor)
    assert {"flatten_state_dict", "flatten_sharded_tensors"} <= set(inspect.signature(DefaultSavePlanner).parameters)


def test_checksummed_and_verifying_refuse_unknown_storage_classes():
    class Other(FileSystemWriter):
        pass

    with pytest.raises(TypeError, match="no checksummed variant"):
        integrity.ChecksummedWriter(Other("/x"))
    with pytest.raises(TypeError, match="no verifying variant"):
        integrity.verifying(object(), layout.Checks(None, {}))


# ------------------------------------------------------------------ raw copies (local and peer tiers)
def _raw_state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "model": {
            "w": torch.randn(33, 7, generator=g),
            "h": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "n": torch.arange(11, dtype=torch.int64),
            "s": torch.tensor(2.5, dtype=torch.float64),  # a 0-dim tensor
            "e": torch.zeros(0, 4),  # an empty one
            "t": torch.randn(6, 8, generator=g).t(),  # not contiguous
        },
        "train": {"step": 9, "skipped": [[1, 2]], "name": "raw"},
    }


def _raw_save(path: Path, sd: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(sd, storage_writer=integrity.RawCopyWriter(str(path)), no_dist=True)


def _raw_load(path: Path, out: dict, checks: layout.Checks | None = None) -> None:
    reader = integrity.verifying(FileSystemReader(str(path)), checks or _checks(path))
    dcp.load(out, storage_reader=reader, no_dist=True)


def _zeros_like(sd: dict) -> dict:
    model = {k: torch.zeros_like(v) for k, v in sd["model"].items()}
    return {"model": model, "train": {"step": 0, "skipped": [], "name": ""}}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_raw_copy_is_the_tensors_bytes_listed_and_loads_back_bitwise(tmp_path):
    """Every tensor item is its own bytes (no torch.save archive), every item is listed with its
    XXH3 and tiles the file, and the verifying reader gives back every tensor and object exactly."""
    path, sd = tmp_path / "raw", _raw_state()
    _raw_save(path, sd)
    table = _table(path)
    assert set(table) == {integrity.RAW_FILE, layout.METADATA}
    data = (path / integrity.RAW_FILE).read_bytes()
    f = table[integrity.RAW_FILE]
    assert f["size"] == len(data) and f["xxh3"] == xxhash.xxh3_64_intdigest(data)
    pos = 0
    for off, length, h in f["items"]:
        assert off == pos and h == xxhash.xxh3_64_intdigest(data[off : off + length])
        pos += length
    assert pos == len(data)
    md = pickle.loads((path / layout.METADATA).read_bytes())  # noqa: S301 - just written
    for idx, info in md.storage_data.items():
        assert info.transform_descriptors == [integrity.RAW], idx
        if idx.fqn in ("model.w", "model.n"):  # the tensor's own bytes, nothing around them
            t = sd["model"][idx.fqn.split(".")[1]]
            assert data[info.offset : info.offset + info.length] == t.numpy().tobytes()
    out = _zeros_like(sd)
    _raw_load(path, out)
    for k, v in sd["model"].items():
        assert out["model"][k].dtype == v.dtype and torch.equal(out["model"][k], v), k
    assert out["train"] == sd["train"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_flipped_byte_in_a_raw_copy_is_refused_and_torch_reader_refuses_it_by_name(tmp_path):
    path, sd = tmp_path / "raw", _raw_state()
    _raw_save(path, sd)
    shard = path / integrity.RAW_FILE
    pristine = shard.read_bytes()
    for off in (0, len(pristine) // 2, len(pristine) - 1):
        _flip(shard, off)
        _raises_integrity(lambda: _raw_load(path, _zeros_like(sd)), "checksum mismatch (corrupted shard)")
        shard.write_bytes(pristine)
    # torch's own reader cannot take raw items: it fails naming the encoding, never misreads them.
    with pytest.raises(CheckpointException, match=integrity.RAW.replace(".", r"\.")):
        dcp.load(_zeros_like(sd), storage_reader=FileSystemReader(str(path)), no_dist=True)
    _raw_load(path, _zeros_like(sd))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_raw_copy_loads_into_a_narrower_request(tmp_path):
    """A load that asks for part of a stored chunk (a reshard) gets exactly that part."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    path, sd = tmp_path / "raw", _raw_state()
    _raw_save(path, sd)
    reader = integrity.verifying(FileSystemReader(str(path)), _checks(path))
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    got = {}

    class Planner:
        def resolve_tensor(self, req):
            return torch.empty(10, 7)

        def commit_tensor(self, req, t):
            got["t"] = t.clone()

    req = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("model.w", torch.Size([0, 0])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("model.w", torch.Size([0, 0])),
        storage_offsets=torch.Size([20, 0]),
        lengths=torch.Size([10, 7]),
    )
    from torch.distributed.checkpoint.planner import LoadPlan

    reader.read_data(LoadPlan([req]), Planner()).wait()
    assert torch.equal(got["t"], sd["model"]["w"][20:30])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_raw_copier_plans_once_per_layout_and_every_copy_loads_back_bitwise(tmp_path):
    """While the layout holds, a copy is written from the first plan (DCP plans once), with the
    objects' new lengths in its metadata; each copy loads back exactly as its own state was. A
    changed shape, dtype or key makes DCP plan again."""
    copier = integrity.RawCopier()
    states = []
    for i in range(5):
        sd = _raw_state()
        sd["model"]["w"] += i
        sd["train"] = {"step": i, "skipped": [[1, 2]] * i, "name": "x" * (i % 3)}  # objects of another length
        path = tmp_path / f"c{i}"
        path.mkdir()
        copier.save(sd, str(path))
        states.append((path, sd))
    assert copier.plans == 1
    for path, sd in states:
        out = _zeros_like(sd)
        _raw_load(path, out)
        for k, v in sd["model"].items():
            assert torch.equal(out["model"][k], v), (path.name, k)
        assert out["train"] == sd["train"], path.name
    for i, change in enumerate(
        (
            lambda sd: sd["model"].update(w=torch.zeros(34, 7)),  # another shape
            lambda sd: sd["model"].update(n=torch.arange(11, dtype=torch.int32)),  # another dtype
            lambda sd: sd["model"].update(extra=torch.ones(2)),  # another key
        )
    ):
        sd = _raw_state()
        change(sd)
        path = tmp_path / f"changed{i}"
        path.mkdir()
        copier.save(sd, str(path))
        assert copier.plans == 2 + i
        out = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "train": {}}
        _raw_load(path, out)
        assert all(torch.equal(out["model"][k], v) for k, v in sd["model"].items())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_raw_copier_reads_a_refilled_staged_copy_in_place_and_each_copy_has_its_own_bytes(tmp_path):
    """A stager refills the same tensors at every save: the copier reads their bytes in place, and
    every copy holds the values of its own save, never an earlier one's."""
    copier = integrity.RawCopier()
    sd = _raw_state()
    kept = {"model": dict(sd["model"]), "train": dict(sd["train"])}
    want = []
    for i in range(4):
        for k, v in kept["model"].items():
            if v.is_floating_point():
                v.copy_(sd["model"][k] + i)  # in place, as the stager does
        kept["train"]["step"] = i
        path = tmp_path / f"c{i}"
        path.mkdir()
        copier.save(kept, str(path))
        want.append((path, {k: v.clone() for k, v in kept["model"].items()}, i))
    assert copier.plans == 1
    for path, model, step in want:
        out = _zeros_like({"model": model})
        _raw_load(path, out)
        assert all(torch.equal(out["model"][k], v) for k, v in model.items()), path.name
        assert out["train"]["step"] == step


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_copy_into_a_recycled_directory_overwrites_its_data_file_in_place_and_cuts_it_to_size(tmp_path):
    """The local tier's spare keeps a retired copy's data file and the next copy rewrites it in
    place: a smaller state leaves no tail of the old one, and the copy loads back exactly."""
    copier = integrity.RawCopier()
    big = _raw_state()
    big["model"]["w"] = torch.randn(300, 7)
    copier.save(big, str(tmp_path))
    data = tmp_path / integrity.RAW_FILE
    inode, size = data.stat().st_ino, data.stat().st_size
    for name in os.listdir(tmp_path):  # what LocalTier.prepare leaves of a spare: the data file alone
        if name != integrity.RAW_FILE:
            os.remove(tmp_path / name)
    small = _raw_state()
    copier.save(small, str(tmp_path))
    assert data.stat().st_ino == inode and data.stat().st_size < size
    out = _zeros_like(small)
    _raw_load(tmp_path, out)
    assert all(torch.equal(out["model"][k], v) for k, v in small["model"].items())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_local_tier_writes_each_copy_into_the_retired_ones_data_file(tmp_path):
    """Retention retires the copy older than the newest two as the rank's spare (uncommitted
    first), and the next copy is written into its data file: the same inode, never listed as a
    copy, and every kept copy loads back as its own state."""
    from elastic_trainer.checkpoint.local_tier import LocalTier

    tier = LocalTier(str(tmp_path / "local"), str(tmp_path / "ckpt"), rank=0, world_size=1, key=None)
    copier, inodes, states = integrity.RawCopier(), {}, {}
    for step in (1, 2, 3, 4):
        sd = _raw_state()
        sd["model"]["w"] += step
        d = tier.prepare("e1", step)
        written = copier.save(sd, d)
        tier.commit(
            "e1",
            step,
            mesh_shape=[1],
            fingerprint="f",
            torch_version="t",
            extra={"remote_chain": [""]},
            written=written,
        )
        inodes[step], states[step] = os.stat(os.path.join(d, integrity.RAW_FILE)).st_ino, sd
    assert inodes[4] == inodes[1] and len({inodes[1], inodes[2], inodes[3]}) == 3
    copies, _ = tier.usable("e1", min_step=0, remote=None, mesh_shape=[1], fingerprint="f")
    assert [c.step for c in copies] == [4, 3]
    spare = os.listdir(os.path.join(tier.root, "e1", ".spare-rank-0-of-1"))
    assert spare and "manifest.json" not in spare  # step 2's, retired after 4 committed
    for c in copies:
        out = _zeros_like(states[c.step])
        _raw_load(Path(c.path), out)
        assert all(torch.equal(out["model"][k], v) for k, v in states[c.step]["model"].items()), c.step
    tier.drop_epoch("e1")
    assert os.listdir(os.path.join(tier.root, "e1")) == []


def test_a_copy_that_fills_its_file_system_names_the_file_and_leaves_no_partial_copy(tmp_path, monkeypatch):
    """A write into a full local tier fails naming its errno and the data file (a descriptor's
    error names none); the failed attempt is removed (its room is free for the next copy), a
    committed copy of the same tier is not."""
    import errno

    from elastic_trainer.checkpoint import failure
    from elastic_trainer.checkpoint.local_tier import LocalTier

    tier = LocalTier(str(tmp_path / "local"), str(tmp_path / "ckpt"), rank=0, world_size=1, key=None)
    copier = integrity.RawCopier()
    d1 = tier.prepare("e1", 1)
    meta = {"mesh_shape": [1], "fingerprint": "f", "torch_version": "t", "extra": {"remote_chain": [""]}}
    tier.commit("e1", 1, written=copier.save(_raw_state(), d1), **meta)

    def full(fd, bufs):
        os.write(fd, bytes(bufs[0])[:3])  # part of it lands, then the file system is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(integrity.os, "writev", full)
    d2 = tier.prepare("e1", 2)
    with pytest.raises(OSError) as e:
        copier.save(_raw_state(), d2)
    assert e.value.errno == errno.ENOSPC and e.value.filename == os.path.join(d2, integrity.RAW_FILE)
    assert failure.describe(e.value) == f"OSError: [Errno 28] No space left on device: {e.value.filename!r}"
    assert os.listdir(d2)  # the partial attempt
    tier.abandon("e1", 2)
    tier.abandon("e1", 1)  # committed: kept
    assert not os.path.exists(d2) and not os.path.exists(os.path.dirname(d2))
    copies, _ = tier.usable("e1", min_step=0, remote=None, mesh_shape=[1], fingerprint="f")
    assert [c.step for c in copies] == [1]


def test_a_copy_written_in_short_writes_is_whole(tmp_path, monkeypatch):
    """The raw writer hands the kernel all items in a few ``writev`` calls; a call that writes
    less than asked (as a file system may) is continued where it stopped, mid-item included."""
    real = os.writev
    calls = []

    def short(fd, bufs):
        calls.append(len(bufs))
        return real(fd, [bytes(bufs[0])[:7]])  # a prefix of what was asked: 7 bytes at most

    monkeypatch.setattr(integrity.os, "writev", short)
    bufs = [memoryview(bytes(range(i, i + 20 + i))) for i in range(9)] + [memoryview(b"")]
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        integrity._write_all(fd, bufs)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(bytes(b) for b in bufs)
    assert len(calls) > len(bufs)  # every call wrote only part of what it was given


_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _random(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 50
    return torch.complex(x, -x).to(dtype) if dtype.is_complex else x.to(dtype)


def test_a_tensor_archive_written_without_torch_save_is_torch_saves_bytes(monkeypatch):
    """For every dtype and rank: the first tensor of a kind goes through torch.save, every later
    one is written from the kept bytes around its storage, and both are byte for byte what
    ``torch.save`` writes (CRC32s off, as the writer saves). Fails when torch's archive changes."""
    real, calls = torch.save, []
    monkeypatch.setattr(torch, "save", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        archives = integrity._TensorArchives()
        for dtype in _DTYPES:
            for shape in [(), (7,), (5, 3), (2, 3, 4)]:
                for seed in (1, 2):  # the first learns the kind, the second is written from it
                    t = _random(dtype, shape, seed)
                    ours, theirs = io.BytesIO(), io.BytesIO()
                    calls.clear()
                    archives.write(t, ours)
                    assert len(calls) == (1 if seed == 1 else 0), (dtype, shape, seed)
                    real(t, theirs)
                    assert ours.getvalue() == theirs.getvalue(), (dtype, shape, seed)
                    assert torch.equal(torch.load(io.BytesIO(ours.getvalue()), weights_only=True), t)
        # contiguous both, one kind each: a size-1 dimension's stride is the tensor's own
        for t in (torch.randn(1, 5), torch.randn(5, 1).t()):
            ours, theirs = io.BytesIO(), io.BytesIO()
            archives.write(t, ours)
            real(t, theirs)
            assert ours.getvalue() == theirs.getvalue() and t.is_contiguous(), t.stride()
    finally:
        torch.serialization.set_crc32_options(previous)


def test_torch_saves_settings_are_part_of_a_kind_and_large_tensors_are_not_learned(monkeypatch):
    """A kind learned under one storage alignment is not reused under another (the archive
    differs), and with CRC32s on every tensor goes through torch.save (its records carry its
    data's); a tensor above the learning bound goes straight into the stream, never into an
    archive held in memory."""
    real, streams = torch.save, []
    monkeypatch.setattr(torch, "save", lambda t, f, **k: (streams.append(f), real(t, f, **k))[1])
    cfg = serialization_config.save
    previous = torch.serialization.get_crc32_options(), cfg.storage_alignment
    archives = integrity._TensorArchives()
    try:
        for crc, alignment in [(False, 64), (False, 4096), (True, 4096), (False, 64)]:
            torch.serialization.set_crc32_options(crc)
            cfg.storage_alignment = alignment
            for seed in (1, 2):
                t = torch.randn(33, generator=torch.Generator().manual_seed(seed))
                ours, theirs = io.BytesIO(), io.BytesIO()
                archives.write(t, ours)
                real(t, theirs)
                assert ours.getvalue() == theirs.getvalue(), (crc, alignment, seed)
        monkeypatch.setattr(integrity._TensorArchives, "_LEARN_MAX_BYTES", 1024)
        for seed in (1, 2):
            streams.clear()
            big, out = torch.randn(257, generator=torch.Generator().manual_seed(seed)), io.BytesIO()
            archives.write(big, out)
            assert streams == [out]  # torch.save into the file itself, each time
        assert not any(k[1] == (257,) for k in archives._parts)
        assert not any(k[1] == (33,) and k[3] == 4096 for k in list(archives._parts)[2:])  # nothing with CRC32s on
    finally:
        torch.serialization.set_crc32_options(previous[0])
        cfg.storage_alignment = previous[1]


def _a_cuda_host(monkeypatch) -> None:
    """What torch's writer sees on a host with CUDA (it then loads tensors through its overlapping
    device loader, ordered by size), on this CPU-only one: a stand-in device module and stream."""
    import contextlib

    import torch.distributed.checkpoint.filesystem as fsmod

    class Stream:
        device_type = "cuda"

        def synchronize(self) -> None: ...

        def wait_stream(self, other) -> None: ...

    class Module:
        stream_ = Stream()

        def current_stream(self):
            return self.stream_

        def stream(self, s):
            return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fsmod, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(fsmod, "_get_device_module", lambda t: Module())


@pytest.mark.parametrize("host", ["cpu", "cuda"])
def test_the_writers_own_file_per_rank_is_the_file_dcp_writes(tmp_path, monkeypatch, host):
    """The checksummed writer writes a rank's file itself (one file, one thread): byte for byte
    the file torch's ``FileSystemWriter`` writes for the same plan, with views, a transposed
    tensor, an empty one, a scalar and pickled objects among the items, at a first save and at
    one whose tensor kinds are all known; on a host with CUDA too, where torch's writer orders
    the tensors by size."""
    if host == "cuda":
        _a_cuda_host(monkeypatch)
    g = torch.Generator().manual_seed(11)
    state = {
        "m": {f"w{i}": torch.randn(9 + i, 5, generator=g) for i in range(12)},
        "view": torch.randn(100, generator=g)[10:30],
        "t": torch.randn(6, 4, generator=g).t(),
        "empty": torch.empty(0),
        "scalar": torch.tensor(2.5),
        "half": torch.randn(8, generator=g).to(torch.bfloat16),
        "obj": {"step": 3, "names": ["a", "b"]},
    }

    class DcpLoop(integrity.ChecksummedWriter):
        def _one_file_per_rank(self) -> bool:
            return False

    files = {}
    for name, cls in (
        ("dcp", DcpLoop),
        ("ours-first", integrity.ChecksummedWriter),
        ("ours", integrity.ChecksummedWriter),
    ):
        dcp.save(state, storage_writer=cls(FileSystemWriter(str(tmp_path / name))), no_dist=True)
        files[name] = (tmp_path / name / "__0_0.distcp").read_bytes()
        assert _table(tmp_path / name)["__0_0.distcp"]["xxh3"] == xxhash.xxh3_64_intdigest(files[name])
    assert files["ours-first"] == files["dcp"] and files["ours"] == files["dcp"]
