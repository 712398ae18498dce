"""Built-in factory for Hugging Face ``transformers`` causal LMs, built from a local config.

    [model]
    factory = "elastic_trainer.models.hf:causal_lm"
    hf_config = "path/to/config.json"      # or the directory holding it
    vocab_size = 32000                     # must equal config.json's vocab_size
    seq_len = 2048                         # <= max_position_embeddings
    # shard_modules defaults to the model's decoder-layer class (_no_split_modules)

Nothing is downloaded: the config is read from disk and the model is built with
``AutoModelForCausalLM.from_config`` (random weights, then our deterministic init), so
``HF_HUB_OFFLINE=1`` works. Weights are kept in fp32 (the master copy); compute precision is
``train.mixed_precision``. ``use_cache`` is switched off for training (no KV cache is built in
the forward pass); export restores the config's own value.

Initialisation follows the transformers convention (``PreTrainedModel._init_weights``):
``Linear``/``Embedding`` weights ~ normal(0, ``initializer_range``), biases 0, norm weights 1,
the embedding's padding row 0, each parameter drawn from its own (seed, name) generator.
Non-persistent buffers (rotary ``inv_freq``) are recomputed after ``to_empty`` from the
module's own config.
Dropout: the config's own dropout settings (``attention_dropout``, ``hidden_dropout`` ...) are
kept and active in training. Dropout draws from each rank's generators, which checkpoints save
per rank (:class:`elastic_trainer.checkpoint.state.RNGState`), so a resume at the same world
size is bitwise exact; set them to 0 in ``config.json`` to train without. ``model.dropout`` is
for the demo model and refused with this factory.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .spec import InitFn, ModelSpec

logger = logging.getLogger(__name__)

FACTORY = "elastic_trainer.models.hf:causal_lm"


def _require_transformers(key: str = "model.factory"):
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            key,
            f"{FACTORY} needs transformers: install the hf extra: pip install -e '.[hf]' in the elastic-trainer clone",
        ) from None
    return transformers


def config_json_path(path: str, key: str = "model.hf_config") -> str:
    """The ``config.json`` that ``path`` names (the file, or the one inside the directory)."""
    if not path:
        raise ConfigError(key, f"must name a local config.json (or its directory) for {FACTORY}")
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(p):
        raise ConfigError(key, f"no such file: {p} (nothing is downloaded: give a local config.json)")
    return p


def load_hf_config(path: str, key: str = "model.hf_config"):
    """A ``PretrainedConfig`` from a local config.json; never touches the network."""
    transformers = _require_transformers()
    p = config_json_path(path, key)
    try:
        with open(p) as f:
            raw: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(key, f"cannot read {p}: {e}") from None
    model_type = raw.pop("model_type", None)
    if not model_type:
        raise ConfigError(key, f"{p} has no model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(key, f"{p}: {e}") from None


def _dtype_kwargs(transformers) -> dict[str, Any]:
    major = int(transformers.__version__.split(".")[0])
    return {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}


def causal_lm(cfg: ModelConfig) -> ModelSpec:
    """Factory: an ``AutoModelForCausalLM`` from ``model.hf_config`` (call it under the meta device)."""
    transformers = _require_transformers()
    hf = load_hf_config(cfg.hf_config)
    if getattr(hf, "vocab_size", None) != cfg.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"is {cfg.vocab_size} but {config_json_path(cfg.hf_config)} has "
            f"vocab_size={getattr(hf, 'vocab_size', None)}: set them equal",
        )
    max_pos = getattr(hf, "max_position_embeddings", None)
    if max_pos is not None and cfg.seq_len > max_pos:
        raise ConfigError(
            "model.seq_len", f"{cfg.seq_len} is longer than max_position_embeddings={max_pos} in {cfg.hf_config}"
        )
    hf.use_cache = False
    kwargs = _dtype_kwargs(transformers)
    try:
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa", **kwargs)
        except ValueError as e:
            if "sdpa" not in str(e).lower():
                raise
            model = transformers.AutoModelForCausalLM.from_config(hf, **kwargs)
    except ValueError as e:
        raise ConfigError("model.hf_config", f"cannot build a causal LM from {cfg.hf_config}: {e}") from None
    shard = sorted(getattr(model, "_no_split_modules", None) or [])
    return ModelSpec(model, init_param=hf_init_param(model), init_buffers=init_buffers, shard_modules=shard)


def _std(config) -> float:
    for name in ("initializer_range", "init_std", "initializer_factor"):
        v = getattr(config, name, None)
        if v:
            return float(v)
    return 0.02


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return (
        isinstance(module, (nn.LayerNorm, nn.GroupNorm))
        or "LayerNorm" in name
        or "RMSNorm" in name
        or name.endswith("Norm")
    )


def hf_init_param(model: nn.Module) -> InitFn:
    """``init_param`` following transformers' default ``_init_weights`` (see module docstring).
    Parameter owners are looked up by name, so it works on the sharded model too."""
    std = _std(model.config)
    owners = dict(model.named_modules())

    def init(name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
        owner_name, _, leaf = name.rpartition(".")
        owner = owners.get(owner_name)
        if leaf == "bias":
            return torch.zeros(shape)
        if owner is not None and _is_norm(owner):
            return torch.ones(shape)
        if owner is None or isinstance(owner, (nn.Linear, nn.Embedding)) or len(shape) > 1:
            w = torch.empty(shape).normal_(0.0, std, generator=g)
            pad = getattr(owner, "padding_idx", None)
            if isinstance(owner, nn.Embedding) and pad is not None:
                w[pad] = 0
            return w
        return torch.ones(shape) if "norm" in owner_name.lower() else torch.zeros(shape)

    return init


@torch.no_grad()
def init_buffers(model: nn.Module) -> None:
    """Recompute every buffer of parameter-free submodules (rotary embeddings): rebuild the
    module on the CPU from its own config and copy its buffers; fall back to the model's
    ``_init_weights`` for modules that cannot be rebuilt that way."""
    for name, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own or any(True for _ in module.parameters(recurse=False)):
            continue
        fresh = None
        config = getattr(module, "config", None)
        if config is not None:
            try:
                with torch.device("cpu"):
                    fresh = type(module)(config=config)
            except TypeError:
                fresh = None
        if fresh is not None:
            src = dict(fresh.named_buffers(recurse=False))
            for bname, buf in own.items():
                if bname in src:
                    buf.copy_(src[bname])
        elif hasattr(model, "_init_weights"):
            model._init_weights(module)  # type: ignore[operator]  # noqa: SLF001 - transformers' own buffer init
        else:
            logger.warning("no way to initialise the buffers of %s (%s)", name, type(module).__name__)
