"""Metrics side channel. Core code talks to a :class:`MetricsSink`; only
``metrics/prometheus.py`` imports ``prometheus_client``."""

from .sink import MetricsSink, NullSink

__all__ = ["MetricsSink", "NullSink"]
