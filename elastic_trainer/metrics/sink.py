"""The metrics seam. Names are full Prometheus names (``elastic_trainer_*``, units in the name,
``_total`` for counters); the catalogue of names lives in :mod:`elastic_trainer.metrics.catalog`."""

from __future__ import annotations

from typing import Protocol


class MetricsSink(Protocol):
    def gauge(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        """``labels``: the catalogue labels of ``name`` other than ``rank`` (which the sink fills)."""

    def counter(self, name: str, amount: float = 1.0) -> None: ...

    def histogram(self, name: str, value: float) -> None: ...


class NullSink:
    """Default sink: drops everything. Core code never needs an exporter."""

    def gauge(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        pass

    def counter(self, name: str, amount: float = 1.0) -> None:
        pass

    def histogram(self, name: str, value: float) -> None:
        pass


class RecordingSink:
    """Keeps the last gauge value, counter sums and histogram observations (tests, reports)."""

    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}
        self.counters: dict[str, float] = {}
        self.histograms: dict[str, list[float]] = {}

    def gauge(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        key = name if not labels else name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        self.gauges[key] = float(value)

    def counter(self, name: str, amount: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + float(amount)

    def histogram(self, name: str, value: float) -> None:
        self.histograms.setdefault(name, []).append(float(value))
