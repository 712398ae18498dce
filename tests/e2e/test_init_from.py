"""Fine-tuning from a local Hugging Face folder (``model.init_from``), issue #12.

A tiny Llama (``tests/data/hf/tiny-llama``) is built and saved with ``transformers``
(``save_pretrained``: config.json + model.safetensors). ``elastic-trainer launch`` at world 2
starts from it: the first step's loss equals the loss ``transformers`` itself computes for the
pretrained model on the same global batch. The fine-tune's checkpoint then resumes like any
other (no second load of the pretrained weights), and weights of another model are refused
before any worker starts, naming the key.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch

from tests.runs import REPO, close_rel, read_events, run_launch, step_losses, write_config

HF_CONFIG = REPO / "tests" / "data" / "hf" / "tiny-llama"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SEQ, GLOBAL, SEED = 32, 6, 7


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(HF_CONFIG))
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # not the init our factory would draw: every tensor visibly "pretrained"
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path_factory.mktemp("pretrained") / "tiny-llama"
    model.save_pretrained(str(out))
    assert (out / "model.safetensors").exists()
    return out


def hf_loss_of_first_batch(model_dir, token_file) -> float:
    """transformers' own loss of the pretrained model on the global batch of step 1."""
    import transformers

    from elastic_trainer.worker.data import StepBatches
    from elastic_trainer.worker.tokens import TokenFile

    batches = StepBatches(TokenFile(token_file, "uint16", SEQ, 512), SEED, GLOBAL, GLOBAL, 1, 0)
    (mb,) = (batches.fetch(m) for m in batches.sampler.at(0))
    window = torch.cat([mb.inputs, mb.targets[:, -1:]], dim=1)  # [B, SEQ+1] tokens; HF shifts the labels itself
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return float(model(input_ids=window, labels=window).loss)


def config(tmp_path, token_file, init_from, **train):
    run_dir = tmp_path / "run"
    model = {
        "factory": "elastic_trainer.models.hf:causal_lm",
        "hf_config": str(HF_CONFIG),
        "vocab_size": 512,
        "seq_len": SEQ,
        "init_from": str(init_from),
    }
    return write_config(
        tmp_path / "ft.toml",
        token_file,
        run_dir,
        model=model,
        train={"steps": 2, "global_batch_size": GLOBAL, "micro_batch_size": 2, "seed": SEED, **train},
        checkpoint={"interval_steps": 1, "mode": "sync"},
    ), run_dir


def test_fine_tune_starts_from_the_pretrained_weights_and_resumes(tmp_path, token_file, pretrained_dir):
    cfg, run_dir = config(tmp_path, token_file, pretrained_dir)
    proc = run_launch(cfg, "--nproc-per-node", "2", env=OFFLINE)
    assert proc.returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]
    (init,) = read_events(run_dir, "init_from")
    assert init["tensors"] == 2 * 9 + 3 and init["files"] == 1  # 9 per layer, embed, norm, lm_head
    first = step_losses(run_dir)[1]
    ref = hf_loss_of_first_batch(pretrained_dir, token_file)
    assert close_rel(first, ref, 1e-5), (first, ref)

    # the fine-tune's checkpoint resumes like any other: no second init_from
    proc = run_launch(cfg, "--nproc-per-node", "2", "--set", "train.steps=3", env=OFFLINE)
    assert proc.returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]
    assert len(read_events(run_dir, "init_from")) == 1
    assert read_events(run_dir, "resume")[-1]["step"] == 2
    assert sorted(step_losses(run_dir)) == [1, 2, 3]


def test_weights_of_another_model_are_refused_before_start(tmp_path, token_file, pretrained_dir):
    import transformers

    other = json.loads((HF_CONFIG / "config.json").read_text())
    other["hidden_size"] = 64
    cfg = transformers.AutoConfig.for_model(other.pop("model_type"), **other)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "other"))
    for init_from, fragment in ((tmp_path / "other", "shape mismatch"), (tmp_path / "missing", "no such file")):
        cfg_path, run_dir = config(tmp_path, token_file, init_from)
        proc = run_launch(cfg_path, "--nproc-per-node", "2", env=OFFLINE, timeout=120)
        log = cfg_path.with_suffix(".log").read_text()
        assert proc.returncode == 2, log[-3000:]
        assert "model.init_from" in log and fragment in log
        assert not read_events(run_dir, "start")
