"""``model.init_from``: which tensors load (pure plan, table-tested), file discovery and the DCP
load itself on one process (a single ``.safetensors`` file, tied weights, dtype conversion)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic_trainer.config import ConfigError, load_config
from elastic_trainer.models import pretrained

pytest.importorskip("safetensors")
from safetensors.torch import save_file

P = {"emb.weight": (8, 4), "head.weight": (8, 4), "norm.weight": (4,)}
TIED = [["emb.weight", "head.weight"]]


@pytest.mark.parametrize(
    "available, buffers, expected",
    [
        ({"emb.weight": (8, 4), "norm.weight": (4,)}, {}, ["emb.weight", "norm.weight"]),
        ({"head.weight": (8, 4), "norm.weight": (4,)}, {}, ["head.weight", "norm.weight"]),  # either tied name
        ({"emb.weight": (8, 4), "head.weight": (8, 4), "norm.weight": (4,)}, {}, ["emb.weight", "norm.weight"]),
        # extra tensors ignored
        ({"emb.weight": (8, 4), "norm.weight": (4,), "extra": (1,)}, {}, ["emb.weight", "norm.weight"]),
        ({"emb.weight": (8, 4), "norm.weight": (4,), "buf": (2,)}, {"buf": (2,)}, ["emb.weight", "norm.weight", "buf"]),
        ({"emb.weight": (8, 4), "norm.weight": (4,)}, {"buf": (2,)}, ["emb.weight", "norm.weight"]),  # buffers optional
    ],
)
def test_plan(available, buffers, expected):
    assert pretrained.plan(P, TIED, buffers, available) == expected


@pytest.mark.parametrize(
    "available, fragment",
    [
        ({"emb.weight": (8, 4)}, "have no norm.weight"),
        ({"norm.weight": (4,)}, "have no emb.weight"),
        ({"emb.weight": (8, 5), "norm.weight": (4,)}, "shape mismatch: emb.weight (8, 5) vs model (8, 4)"),
    ],
)
def test_plan_errors_name_the_key(available, fragment):
    with pytest.raises(ConfigError, match="model.init_from") as e:
        pretrained.plan(P, TIED, {}, available)
    assert fragment in str(e.value)


def test_files(tmp_path):
    with pytest.raises(ConfigError, match="model.init_from.*no such file"):
        pretrained.safetensors_files(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no .safetensors files"):
        pretrained.safetensors_files(str(tmp_path))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a .safetensors file"):
        pretrained.safetensors_files(str(tmp_path / "w.bin"))
    save_file({"a": torch.zeros(2, 3)}, str(tmp_path / "model-00002.safetensors"))
    save_file({"b": torch.zeros(4)}, str(tmp_path / "model-00001.safetensors"))
    files = pretrained.safetensors_files(str(tmp_path))
    assert [f.rsplit("/", 1)[1] for f in files] == ["model-00001.safetensors", "model-00002.safetensors"]
    assert pretrained.file_shapes(files) == {"a": (2, 3), "b": (4,)}
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="cannot read"):
        pretrained.file_shapes([str(tmp_path / "bad.safetensors")])


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight
        self.norm = nn.LayerNorm(4)


def test_load_single_file_among_others_with_tied_weights_and_bf16(tmp_path):
    """One file named by path (another file in the folder is not read); the tied head follows
    the embedding; bf16 weights land in the fp32 model."""
    src = Tied()
    emb = torch.randn(8, 4).to(torch.bfloat16)
    save_file(
        {"emb.weight": emb, "norm.weight": torch.full((4,), 2.0), "norm.bias": torch.full((4,), -1.0)},
        str(tmp_path / "model.safetensors"),
    )
    save_file({"emb.weight": torch.zeros(3, 3)}, str(tmp_path / "other.safetensors"))  # would clash if read
    stats = pretrained.load_pretrained(src, str(tmp_path / "model.safetensors"))
    assert stats["tensors"] == 3 and stats["files"] == 1
    assert src.emb.weight.dtype == torch.float32
    assert torch.equal(src.emb.weight, emb.float()) and torch.equal(src.head.weight, emb.float())
    assert torch.equal(src.norm.weight, torch.full((4,), 2.0)) and torch.equal(src.norm.bias, torch.full((4,), -1.0))


def test_init_from_is_not_part_of_the_model_fingerprint():
    base = ["data.path=x", "checkpoint.dir=/tmp/x"]
    a = load_config(None, base)
    b = load_config(None, [*base, "model.init_from=/weights"])
    assert b.model.init_from == "/weights"
    assert a.model_fingerprint() == b.model_fingerprint()
