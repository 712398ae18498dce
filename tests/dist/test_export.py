"""`ckpt export` gives one safetensors file that a plain, unsharded model loads with the same
logits as the sharded model it came from."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from elastic_trainer.config import config_from_dict
from elastic_trainer.worker.model import GPT

from .harness import run_ranks
from .workloads import TINY, logits_after_load, save_after_training


@pytest.mark.soak  # tests/e2e/test_user_models.py's export test checks the same logits (through from_pretrained)
def test_exported_weights_reproduce_the_sharded_logits(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(save_after_training, 2, ckpt, "sync")
    sharded = run_ranks(logits_after_load, 2, ckpt)[0]
    out = tmp_path / "model.safetensors"
    r = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", "ckpt", "export", ckpt, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    weights = load_file(str(out))
    model = GPT(config_from_dict(TINY).model)
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        plain = model(sharded["x"])
    torch.testing.assert_close(plain, sharded["logits"], rtol=1e-6, atol=1e-6)
    bf16 = tmp_path / "model-bf16.safetensors"
    r = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", "ckpt", "export", ckpt, "--out", str(bf16), "--dtype", "bf16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and all(t.dtype == torch.bfloat16 for t in load_file(str(bf16)).values())
