"""The model seam (no process group): factory loading and its errors, init/buffer contract,
the built-in Hugging Face factory and the HF export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from elastic_trainer.config import ModelConfig, config_from_dict
from elastic_trainer.errors import ConfigError
from elastic_trainer.models import ModelSpec
from elastic_trainer.worker.model_factory import build_model, build_model_spec, check_model, initialise_buffers
from elastic_trainer.worker.parallel import deterministic_init

HERE = "tests.unit.test_model_factory"
HF_CONFIG = str(Path(__file__).resolve().parents[1] / "data" / "hf" / "tiny-llama")
HF = "elastic_trainer.models.hf:causal_lm"


class Layer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + self.lin(x)


class Tiny(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Layer(cfg.dim) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class BufferNoInit(Tiny):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.register_buffer("scale", torch.ones(cfg.dim), persistent=False)
        self.register_buffer("shift", torch.zeros(cfg.dim), persistent=False)


class WithBuffer(BufferNoInit):
    def init_buffers(self):
        self.scale.fill_(1.0)  # forgets ``shift``


def tiny(cfg):
    return Tiny(cfg)


def tiny_spec(cfg):
    model = BufferNoInit(cfg)

    def init_buffers(m):
        m.scale.fill_(1.0)
        m.shift.zero_()

    return ModelSpec(model, init_buffers=init_buffers, shard_modules=["Layer"])


def with_buffer_no_init(cfg):
    return BufferNoInit(cfg)


def with_forgetful_init(cfg):
    return WithBuffer(cfg)


def not_a_module(cfg):
    return {"model": 1}


def raises(cfg):
    raise RuntimeError("boom")


def mcfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, seq_len=16, dim=16, n_layers=2, n_heads=2)
    base.update(kw)
    return ModelConfig(**base)


def meta_spec(cfg: ModelConfig) -> ModelSpec:
    with torch.device("meta"):
        return build_model_spec(cfg)


@pytest.mark.parametrize(
    "factory, fragment",
    [
        ("no_such_package.models:build", "cannot import module 'no_such_package.models'"),
        (f"{HERE}:missing_function", "has no callable 'missing_function'"),
        (f"{HERE}:not_a_module", "not a torch.nn.Module"),
        (f"{HERE}:raises", "RuntimeError: boom"),
        (f"{HERE}:", "expected 'package.module:function'"),
    ],
)
def test_bad_factories_name_model_factory(factory, fragment):
    with pytest.raises(ConfigError) as e:
        meta_spec(mcfg(factory=factory, shard_modules=["Layer"]))
    assert e.value.key == "model.factory"
    assert fragment in str(e.value)


def test_unknown_shard_class_names_the_key_and_lists_classes():
    with pytest.raises(ConfigError) as e:
        meta_spec(mcfg(factory=f"{HERE}:tiny", shard_modules=["Block"]))
    assert e.value.key == "model.shard_modules"
    assert "'Block'" in str(e.value) and "Layer" in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_model(mcfg(factory=f"{HERE}:tiny"))
    assert e.value.key == "model.shard_modules"


def test_user_factory_default_init_is_deterministic_and_world_size_free():
    cfg = mcfg(factory=f"{HERE}:tiny", shard_modules=["Layer"])
    a, b = meta_spec(cfg), meta_spec(cfg)
    for spec in (a, b):
        spec.model.to_empty(device="cpu")
        deterministic_init(spec.model, 3, spec.init_param)
        initialise_buffers(spec.model, spec.init_buffers)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert torch.all(a.model.layers[0].lin.bias == 0)
    assert build_model(cfg)[2] == ["Layer"]


def test_buffers_need_an_initialiser():
    with pytest.raises(ConfigError) as e:
        meta_spec(mcfg(factory=f"{HERE}:with_buffer_no_init", shard_modules=["Layer"]))
    assert e.value.key == "model.factory" and "init_buffers" in str(e.value)


def test_a_buffer_the_initialiser_forgets_is_caught():
    spec = meta_spec(mcfg(factory=f"{HERE}:with_forgetful_init", shard_modules=["Layer"]))
    spec.model.to_empty(device="cpu")
    with pytest.raises(ConfigError) as e:
        initialise_buffers(spec.model, spec.init_buffers)
    assert e.value.key == "model.factory" and "shift" in str(e.value)


def test_model_spec_factory():
    spec = meta_spec(mcfg(factory=f"{HERE}:tiny_spec"))
    assert spec.shard_modules == ["Layer"]
    spec.model.to_empty(device="cpu")
    initialise_buffers(spec.model, spec.init_buffers)
    assert torch.equal(spec.model.shift, torch.zeros(16))


def test_demo_model_unchanged():
    spec = meta_spec(mcfg())
    assert spec.shard_modules == ["Block"] and not list(spec.model.buffers())


# ---------------------------------------------------------------- Hugging Face
transformers = pytest.importorskip("transformers")


def hf_cfg(**kw) -> ModelConfig:
    return mcfg(factory=HF, hf_config=HF_CONFIG, vocab_size=512, seq_len=32, **kw)


def materialise(spec: ModelSpec, seed: int = 5) -> nn.Module:
    """The trainer's init path without sharding. (Unsharded ``to_empty`` unties tied weights,
    fully_shard'ed ones stay tied, so tie them again here.)"""
    spec.model.to_empty(device="cpu")
    if getattr(spec.model.config, "tie_word_embeddings", False):
        spec.model.tie_weights()
    deterministic_init(spec.model, seed, spec.init_param)
    initialise_buffers(spec.model, spec.init_buffers)
    return spec.model


def test_hf_factory_builds_offline_and_matches_transformers(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = meta_spec(hf_cfg())
    assert spec.shard_modules == ["LlamaDecoderLayer"]
    assert all(p.device.type == "meta" for p in spec.model.parameters())
    model = materialise(spec)
    ref = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(HF_CONFIG, local_files_only=True), attn_implementation="sdpa"
    )
    ref.load_state_dict(model.state_dict())
    for (n, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        assert torch.equal(b, rb), n  # rotary inv_freq recomputed after to_empty
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=0, atol=0)
    w = dict(model.named_parameters())
    assert torch.equal(w["model.norm.weight"], torch.ones(32))
    assert abs(float(w["model.layers.0.mlp.up_proj.weight"].detach().std()) - 0.02) < 0.004
    other = materialise(meta_spec(hf_cfg()))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters(), strict=True))


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"vocab_size": 500}, "model.vocab_size"),
        ({"seq_len": 128}, "model.seq_len"),
        ({"hf_config": "/nonexistent/dir"}, "model.hf_config"),
    ],
)
def test_hf_factory_errors_name_the_key(kw, key):
    base = dict(factory=HF, hf_config=HF_CONFIG, vocab_size=512, seq_len=32)
    base.update(kw)
    with pytest.raises(ConfigError) as e:
        meta_spec(mcfg(**base))
    assert e.value.key == key


def test_hf_config_without_factory_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"hf_config": HF_CONFIG}})
    assert e.value.key == "model.hf_config"


def test_demo_gpt_exports_to_gpt2_with_identical_logits(tmp_path):
    from elastic_trainer.models.hf_export import write_hf_folder
    from elastic_trainer.worker.model import GPT

    cfg = ModelConfig(vocab_size=256, seq_len=32, dim=32, n_layers=2, n_heads=2, mlp_ratio=2)
    gpt = GPT(cfg)
    deterministic_init(gpt, 3, gpt.init_param)
    info = write_hf_folder(gpt.state_dict(), cfg, str(tmp_path))
    assert info["architecture"] == "GPT2LMHeadModel"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, gpt(x), rtol=1e-6, atol=1e-6)


def test_llama_export_round_trips_tied_embeddings(tmp_path):
    import json

    from elastic_trainer.models.hf_export import write_hf_folder

    conf = json.loads(Path(HF_CONFIG, "config.json").read_text())
    conf["tie_word_embeddings"] = True
    Path(tmp_path, "src").mkdir()
    Path(tmp_path, "src", "config.json").write_text(json.dumps(conf))
    cfg = mcfg(factory=HF, hf_config=str(tmp_path / "src"), vocab_size=512, seq_len=32)
    model = materialise(meta_spec(cfg))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    write_hf_folder(model.state_dict(), cfg, str(tmp_path / "out"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    x = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits, rtol=1e-6, atol=1e-6)


def test_export_takes_a_hugging_face_config_or_a_training_config(tmp_path):
    """``ckpt export --hf SOURCE``: a folder with a config.json (a Trainer's output_dir) or the
    file is a model of the built-in HF factory; a folder without one is refused naming --hf."""
    from elastic_trainer.models.hf import FACTORY
    from elastic_trainer.models.hf_export import export_model_config

    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "out")
    for source in (tmp_path / "out", tmp_path / "out" / "config.json"):
        m = export_model_config(str(source))
        assert m.factory == FACTORY and m.hf_config == str(source)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        export_model_config(str(tmp_path / "empty"))
    assert e.value.key == "--hf" and "config.json" in str(e.value)
    toml = tmp_path / "train.toml"
    toml.write_text('[model]\ndim = 48\n[data]\npath = "x.bin"\n')
    assert export_model_config(str(toml)).dim == 48
