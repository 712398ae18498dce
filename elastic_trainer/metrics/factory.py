"""Builds the metrics sink for a process from the config. Prometheus when enabled."""

from __future__ import annotations

from ..config import Config
from .sink import MetricsSink, NullSink


def worker_sink(cfg: Config, rank: int) -> MetricsSink:
    if cfg.metrics.port == 0:
        return NullSink()
    try:
        from .prometheus import make_worker_sink
    except ImportError:
        return NullSink()
    return make_worker_sink(cfg, rank)


def start_supervisor_exporter(cfg: Config):
    """Start the node's exporter in the supervisor (which outlives worker restarts), before
    any worker starts. Returns an object with ``sink`` (the supervisor's own MetricsSink) and
    ``stop()``, or None when metrics are disabled."""
    if cfg.metrics.port == 0:
        return None
    try:
        from .prometheus import start_supervisor_exporter as start
    except ImportError:
        return None
    return start(cfg)
