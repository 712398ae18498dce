"""Checks of the data source that run in the supervisor, before any worker starts."""

from __future__ import annotations

from .config import Config
from .worker.data import TokenFile


def check_data_source(cfg: Config) -> None:
    """Raise ConfigError naming the key if the token file is missing or does not fit the model."""
    TokenFile(cfg.data.path, cfg.data.dtype, cfg.model.seq_len, cfg.model.vocab_size)
