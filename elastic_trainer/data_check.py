"""Checks of the data source and the model seam that run in the supervisor, before any worker starts."""

from __future__ import annotations

from .config import Config


def check_data_source(cfg: Config) -> None:
    """Raise ConfigError naming the key if the model factory cannot be imported or names
    unknown shard classes, or the data source is missing or does not fit the model.

    For text/token-list sources this also builds the packed token stream (once per node), so
    workers only memory-map it."""
    from .worker.model_factory import check_model
    from .worker.sources import open_source

    check_model(cfg.model)
    open_source(cfg)
