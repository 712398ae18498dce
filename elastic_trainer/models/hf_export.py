"""Export a checkpoint's model as a Hugging Face folder (``config.json`` + ``model.safetensors``)
that ``AutoModelForCausalLM.from_pretrained(folder)`` loads, offline.

* Models of the built-in HF factory (:mod:`elastic_trainer.models.hf`): parameter names already
  are transformers' names; the config is ``model.hf_config`` as written (its own ``use_cache``).
* The demo GPT (``model.factory = ""``) maps onto ``GPT2LMHeadModel`` exactly (exact GELU, no
  dropout, untied head; GPT-2's ``Conv1D`` stores weights transposed).

Reached through ``elastic-trainer ckpt export URI --out DIR --hf CONFIG`` (CONFIG is the training
config, whose ``[model]`` section says what the weights are, or a Hugging Face ``config.json`` or
a folder holding one: what a Transformers ``Trainer`` run's ``save_model()`` wrote), or
:func:`export_hf` from Python.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConfigError
from .hf import FACTORY, _require_transformers, load_hf_config


def gpt2_config(m: ModelConfig):
    """The ``GPT2Config`` that computes exactly what the demo GPT of ``m`` computes."""
    transformers = _require_transformers("model.factory")
    return transformers.GPT2Config(
        vocab_size=m.vocab_size,
        n_positions=m.seq_len,
        n_embd=m.dim,
        n_layer=m.n_layers,
        n_head=m.n_heads,
        n_inner=m.mlp_ratio * m.dim,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        architectures=["GPT2LMHeadModel"],
    )


_GPT2_NAMES = [
    (r"tok_emb\.weight", "transformer.wte.weight", False),
    (r"pos_emb\.weight", "transformer.wpe.weight", False),
    (r"blocks\.(\d+)\.ln1\.(weight|bias)", r"transformer.h.\1.ln_1.\2", False),
    (r"blocks\.(\d+)\.ln2\.(weight|bias)", r"transformer.h.\1.ln_2.\2", False),
    (r"blocks\.(\d+)\.attn\.qkv\.weight", r"transformer.h.\1.attn.c_attn.weight", True),
    (r"blocks\.(\d+)\.attn\.qkv\.bias", r"transformer.h.\1.attn.c_attn.bias", False),
    (r"blocks\.(\d+)\.attn\.proj\.weight", r"transformer.h.\1.attn.c_proj.weight", True),
    (r"blocks\.(\d+)\.attn\.proj\.bias", r"transformer.h.\1.attn.c_proj.bias", False),
    (r"blocks\.(\d+)\.fc\.weight", r"transformer.h.\1.mlp.c_fc.weight", True),
    (r"blocks\.(\d+)\.fc\.bias", r"transformer.h.\1.mlp.c_fc.bias", False),
    (r"blocks\.(\d+)\.fc_out\.weight", r"transformer.h.\1.mlp.c_proj.weight", True),
    (r"blocks\.(\d+)\.fc_out\.bias", r"transformer.h.\1.mlp.c_proj.bias", False),
    (r"ln_f\.(weight|bias)", r"transformer.ln_f.\1", False),
    (r"head\.weight", "lm_head.weight", False),
]


def demo_to_gpt2(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in weights.items():
        for pat, repl, transpose in _GPT2_NAMES:
            if re.fullmatch(pat, name):
                out[re.sub(pat, repl, name)] = t.t() if transpose else t
                break
        else:
            raise ConfigError("model.factory", f"demo GPT weight {name} has no GPT-2 counterpart")
    return out


def hf_config_and_weights(weights: dict[str, torch.Tensor], model: ModelConfig) -> tuple[Any, dict[str, torch.Tensor]]:
    """(transformers config, state dict in transformers' names) for a model of config ``model``."""
    if not model.factory:
        return gpt2_config(model), demo_to_gpt2(weights)
    if model.factory != FACTORY:
        raise ConfigError(
            "model.factory", f"HF export supports {FACTORY!r} models and the demo GPT, not {model.factory!r}"
        )
    config = load_hf_config(model.hf_config)
    transformers = _require_transformers()
    if not getattr(config, "architectures", None):
        config.architectures = [transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]
    weights = dict(weights)
    if getattr(config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # tied to the input embedding; safetensors refuses shared storage
    return config, weights


def write_hf_folder(
    weights: dict[str, torch.Tensor],
    model: ModelConfig,
    out_dir: str,
    dtype: str = "fp32",
    metadata: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Write ``out_dir/config.json`` and ``out_dir/model.safetensors``."""
    from safetensors.torch import save_file

    config, tensors = hf_config_and_weights(weights, model)
    target = torch.bfloat16 if dtype == "bf16" else torch.float32
    tensors = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    config.dtype = "bfloat16" if dtype == "bf16" else "float32"
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    return {
        "out": out_dir,
        "architecture": config.architectures[0],
        "tensors": len(tensors),
        "dtype": dtype,
        "parameters": sum(v.numel() for v in tensors.values()),
    }


def export_model_config(source: str) -> ModelConfig:
    """What ``ckpt export --hf SOURCE`` says the weights are: a Hugging Face ``config.json`` (or a
    folder holding one, such as the ``output_dir`` a Transformers ``Trainer`` saved its model to)
    is a model of the built-in HF factory; anything else is a training config (its ``[model]``)."""
    from ..config import load_config

    if os.path.isdir(source) or source.endswith(".json"):
        load_hf_config(source, key="--hf")  # readable, with a model_type: named here, not mid-export
        return ModelConfig(factory=FACTORY, hf_config=source)
    return load_config(source).model


def export_hf(
    uri: str, out_dir: str, model: ModelConfig, step: int | None = None, dtype: str = "fp32", endpoint_url: str = ""
) -> dict[str, Any]:
    """Consolidate the checkpoint of ``step`` (default: latest committed) under ``uri`` into an HF folder."""
    from ..checkpoint.tools import load_model_weights

    step, weights = load_model_weights(uri, step, endpoint_url)
    info = write_hf_folder(weights, model, out_dir, dtype, metadata={"step": str(step), "source": uri})
    return {"step": step, **info}
