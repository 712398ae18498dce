"""The metric catalogue: Prometheus naming conventions, and every name the code records is in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elastic_trainer.metrics import catalog

PACKAGE = Path(__file__).resolve().parents[2] / "elastic_trainer"
SINK_CALL = re.compile(r"\.(gauge|counter|histogram)\(\s*\"(elastic_trainer_[a-z0-9_]+)\"")


def test_catalogue_follows_conventions():
    assert catalog.problems() == []


@pytest.mark.parametrize(
    "bad, problem",
    [
        (catalog.Metric("elastic_trainer_restarts", catalog.COUNTER, "h", "supervisor"), "_total"),
        (catalog.Metric("elastic_trainer_loss_total", catalog.GAUGE, "h", "global", mode="max"), "_total"),
        (catalog.Metric("elastic_trainer_save_ms", catalog.HISTOGRAM, "h", "global", buckets=(1.0,)), "unit"),
        (catalog.Metric("elastic_trainer_stepTime", catalog.GAUGE, "h", "global", mode="max"), "snake_case"),
        (catalog.Metric("elastic_trainer_x_bytes", catalog.GAUGE, "", "global", mode="max"), "empty help"),
        (catalog.Metric("elastic_trainer_x_bytes", catalog.GAUGE, "h", "global"), "multiprocess mode"),
        (catalog.Metric("elastic_trainer_x_bytes", catalog.GAUGE, "h", "rank", mode="max"), "rank label"),
        (catalog.Metric("elastic_trainer_x_bytes", catalog.GAUGE, "h", "global", ("host",), mode="max"), "labels"),
        (
            catalog.Metric("elastic_trainer_x_seconds", catalog.HISTOGRAM, "h", "global", buckets=(2.0, 1.0)),
            "increasing",
        ),
    ],
)
def test_problems_are_caught(bad, problem):
    assert any(problem in p for p in catalog.problems((bad,))), catalog.problems((bad,))


def test_issue_metric_set_is_covered():
    names = set(catalog.METRICS)
    for fragment in (
        "train_step",
        "train_loss",
        "train_learning_rate",
        "train_grad_norm",
        "train_tokens_per_second",
        "train_step_duration_seconds",
        "train_samples_total",
        "checkpoint_stall_seconds",
        "checkpoint_save_duration_seconds",
        "checkpoint_written_bytes_total",
        "checkpoint_last_committed_step",
        "checkpoint_last_commit_timestamp_seconds",
        "checkpoint_save_failures_total",
        "checkpoint_saves_in_flight",
        "checkpoint_resume_load_seconds",
        "world_size",
        "restarts_total",
        "rendezvous_rounds_total",
        "reshard_events_total",
        "recovery_seconds",
        "hang_detections_total",
        "process_resident_memory_bytes",
        "process_cuda_memory_allocated_bytes",
    ):
        assert f"elastic_trainer_{fragment}" in names


def recorded_names() -> dict[str, set[str]]:
    """Metric names passed to a sink anywhere in the package, by call kind."""
    out: dict[str, set[str]] = {}
    for f in PACKAGE.rglob("*.py"):
        for kind, name in SINK_CALL.findall(f.read_text()):
            out.setdefault(name, set()).add(kind)
    return out


def test_every_recorded_name_is_catalogued_with_its_type():
    used = recorded_names()
    assert len(used) >= 20, "the source scan found too few sink calls"
    for name, kinds in sorted(used.items()):
        assert name in catalog.METRICS, f"{name} is recorded but not in metrics/catalog.py"
        assert kinds == {catalog.METRICS[name].type}, (
            f"{name} recorded as {kinds}, catalogued as {catalog.METRICS[name].type}"
        )


def test_every_catalogued_metric_is_recorded_somewhere():
    used = recorded_names()
    assert sorted(set(catalog.METRICS) - set(used)) == []


def test_only_the_exporter_imports_prometheus_client():
    importers = sorted(
        str(f.relative_to(PACKAGE))
        for f in PACKAGE.rglob("*.py")
        if re.search(r"^\s*(import|from)\s+prometheus_client", f.read_text(), re.M)
    )
    assert importers == ["metrics/prometheus.py"]


def test_docs_list_every_metric():
    docs = (PACKAGE.parent / "docs" / "metrics.md").read_text()
    for m in catalog.CATALOG:
        assert f"`{m.name}`" in docs, f"docs/metrics.md does not describe {m.name}"
    assert "9400" in docs
