"""Alert rules (promtool check + rule unit tests) and the Grafana dashboard's structure.
The dashboard's queries are checked against the real exposition in test_metrics_exporter.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_alert_rules_pass_promtool_check(promtool):
    r = subprocess.run(
        [promtool, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_rules_unit_tests_pass(promtool):
    """Each alert fires on a synthetic failure history and stays quiet on a healthy one."""
    r = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"],
        cwd=DEPLOY / "prometheus",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_nonfinite_alert_fires_on_the_counter_alone(promtool, tmp_path):
    """A non-finite step never writes the loss gauge: the alert must fire on the counter alone."""
    import yaml

    rule = next(
        r
        for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
        if r["alert"] == "ElasticTrainerNonFiniteLoss"
    )
    fired = {
        "exp_labels": {"severity": "critical", "job": "train", "run": "r"},
        "exp_annotations": {
            "summary": "train/r: a NaN/infinite loss or gradient norm (1 in 15 minutes)",
            "description": rule["annotations"]["description"],
        },
    }
    case = {
        "rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": 'elastic_trainer_train_nonfinite_events_total{job="train",run="r"}',
                        "values": "0 0 1 1 1 1",
                    }
                ],
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": "ElasticTrainerNonFiniteLoss", "exp_alerts": []},
                    {"eval_time": "3m", "alertname": "ElasticTrainerNonFiniteLoss", "exp_alerts": [fired]},
                ],
            }
        ],
    }
    f = tmp_path / "nonfinite_test.yml"
    f.write_text(yaml.safe_dump(case))
    r = subprocess.run([promtool, "test", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_set_covers_the_issue():
    import yaml

    names = {
        r["alert"]
        for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    }
    assert {
        "ElasticTrainerCheckpointTooOld",
        "ElasticTrainerRestartsRising",
        "ElasticTrainerThroughputCollapse",
        "ElasticTrainerJobStalled",
    } <= names


def test_example_prometheus_config_is_valid(promtool, tmp_path):
    """Valid where it is meant to be used: beside its rules and the job's metrics token file."""
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(DEPLOY / "prometheus" / name, tmp_path / name)
    (tmp_path / "elastic-trainer-metrics.token").write_text("a-token\n")
    r = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_is_importable_grafana_json():
    dash = json.loads((DEPLOY / "grafana" / "elastic-trainer.json").read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "job" in variables
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("throughput", "loss", "checkpoint stall", "checkpoint age", "restarts", "world size"):
        assert topic in titles, f"no panel about {topic}"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"], p["title"]
