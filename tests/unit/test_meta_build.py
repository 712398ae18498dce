"""Models are built on the meta device without running initialisers (``models.spec.on_meta``).

The reason is a torch internal that can change: a value-filling op on a meta tensor goes
through torch's reference implementations, whose first use imports ``torch._dynamo`` (about a
second of every ``launch``). The first test fails loudly if building the model imports it again."""

from __future__ import annotations

import torch

from elastic_trainer.models.spec import on_meta
from tests import runs


def test_building_the_model_on_meta_imports_no_dynamo():
    code = (
        "import sys\n"
        "from elastic_trainer.config import ModelConfig\n"
        "from elastic_trainer.worker.model_factory import check_model\n"
        "check_model(ModelConfig(vocab_size=256, seq_len=32, dim=32, n_layers=2, n_heads=2))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = runs.python_c(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", (
        "a meta-device build imports torch._dynamo again (see elastic_trainer/models/spec.py)"
    )


def test_fill_ops_are_no_ops_on_meta_and_shapes_still_change():
    with on_meta():
        lin = torch.nn.Linear(4, 3)
        emb = torch.nn.Embedding(5, 2)
        torch.nn.init.trunc_normal_(lin.weight, std=0.02)
        lin.weight.data.normal_(0.0, 1.0)
        emb.weight.fill_(1.0)
        t = torch.empty(2, 3)
        t.unsqueeze_(0)  # not a fill: must still act
    assert lin.weight.is_meta and emb.weight.is_meta and tuple(lin.weight.shape) == (3, 4)
    assert tuple(t.shape) == (1, 2, 3)


def test_real_tensors_are_filled_as_usual_inside_the_context():
    with on_meta():
        real = torch.zeros(3, device="cpu")
        torch.nn.init.ones_(real)
        real.normal_(5.0, 0.0)
    assert torch.equal(real, torch.full((3,), 5.0))
