"""The node exporter with real worker processes: multiprocess aggregation, restarts, liveness,
``promtool check metrics`` on the full exposition, and the Grafana dashboard's queries checked
against what the exporter really exports (and against promtool's PromQL parser)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from elastic_trainer import contract
from elastic_trainer.config import Config, MetricsConfig, RunConfig
from elastic_trainer.metrics import catalog, factory, prometheus
from elastic_trainer.metrics.sink import NullSink
from tests import runs
from tests.fixtures.procs import free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "elastic-trainer.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"

# A stand-in worker: builds its sink as a real worker does (env from the "supervisor"), records
# the calls given as JSON, prints "ready", and exits when its stdin closes.
WORKER = r"""
import json, os, sys
from elastic_trainer.config import Config
from elastic_trainer.metrics.prometheus import make_worker_sink
rank, calls = int(sys.argv[1]), json.loads(sys.argv[2])
sink = make_worker_sink(Config(), rank)
for kind, name, value, *labels in calls:
    getattr(sink, kind)(name, value, *labels)
print("ready", flush=True)
sys.stdin.read()
"""


class Worker:
    def __init__(self, rank: int, calls: list):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(rank), json.dumps(calls)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"worker rank {rank} did not start (exit {self.proc.poll()})"

    def exit(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=20) == 0


@pytest.fixture
def exporter(tmp_path, monkeypatch):
    """A supervisor exporter serving on a free 127.0.0.1 port; restores prometheus_client's
    process-global value class and the environment afterwards."""
    from prometheus_client import values

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv(contract.METRICS_TOKEN_ENV, runs.METRICS_TOKEN)
    original = values.ValueClass
    cfg = Config(run=RunConfig(dir=str(tmp_path / "run")), metrics=MetricsConfig(port=free_port(), host="127.0.0.1"))
    exp = factory.start_supervisor_exporter(cfg)
    try:
        yield exp
    finally:
        exp.stop()
        values.ValueClass = original
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def scrape(exp) -> str:
    host, port = exp.address
    return runs.scrape(port, host)


def samples(text: str, run: str = "elastic-trainer") -> dict[str, float]:
    """``{'name{labels}': value}`` of an exposition (comments dropped), each sample's ``run``
    label checked and left out of the key."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            assert f'run="{run}"' in key, f"sample without run={run!r}: {line}"
            key = re.sub(r'run="[^"]*",?', "", key).replace(",}", "}").replace("{}", "")
            out[key] = float(value)
    return out


def test_disabled_metrics_build_nothing():
    cfg = Config(metrics=MetricsConfig(port=0))
    assert isinstance(factory.worker_sink(cfg, 0), NullSink)
    assert factory.start_supervisor_exporter(cfg) is None


def test_counters_survive_worker_restarts_and_gauges_follow_live_workers(exporter):
    s = samples(scrape(exporter))
    assert s["elastic_trainer_restarts_total"] == 0, "supervisor counters exist from the start"
    assert s["elastic_trainer_rendezvous_rounds_total"] == 0

    # Incarnation 1: both ranks record the same job-wide values; only rank 0's count.
    job_wide = [
        ["gauge", "elastic_trainer_train_step", 5],
        ["gauge", "elastic_trainer_world_size", 2],
        ["counter", "elastic_trainer_train_samples_total", 50],
        ["histogram", "elastic_trainer_train_step_duration_seconds", 0.2],
        ["gauge", "elastic_trainer_checkpoint_last_committed_step", 5],
    ]
    w0 = Worker(0, job_wide + [["gauge", "elastic_trainer_process_resident_memory_bytes", 1000]])
    w1 = Worker(1, job_wide + [["gauge", "elastic_trainer_process_resident_memory_bytes", 2000]])
    s = samples(scrape(exporter))
    assert s["elastic_trainer_train_step"] == 5
    assert s["elastic_trainer_world_size"] == 2
    assert s["elastic_trainer_train_samples_total"] == 50, "job-wide counters are recorded by rank 0 only"
    assert s["elastic_trainer_train_step_duration_seconds_count"] == 1
    assert s['elastic_trainer_process_resident_memory_bytes{rank="0"}'] == 1000
    assert s['elastic_trainer_process_resident_memory_bytes{rank="1"}'] == 2000
    assert not any('pid="' in k for k in s), "no per-process labels"

    # The workers die: live gauges go, counters and the last commit stay.
    w0.exit()
    w1.exit()
    exporter.sink.counter("elastic_trainer_restarts_total")
    exporter.sink.histogram("elastic_trainer_recovery_seconds", 3.0)
    s = samples(scrape(exporter))
    assert "elastic_trainer_train_step" not in s
    assert "elastic_trainer_world_size" not in s
    assert not any(k.startswith("elastic_trainer_process_resident_memory_bytes") for k in s)
    assert s["elastic_trainer_train_samples_total"] == 50
    assert s["elastic_trainer_checkpoint_last_committed_step"] == 5
    assert s["elastic_trainer_restarts_total"] == 1
    assert s["elastic_trainer_recovery_seconds_count"] == 1

    # Incarnation 2 resumes: counters keep adding up, gauges show the new workers.
    w0 = Worker(
        0,
        [
            ["gauge", "elastic_trainer_train_step", 3],
            ["counter", "elastic_trainer_train_samples_total", 30],
            ["gauge", "elastic_trainer_world_size", 1],
        ],
    )
    s = samples(scrape(exporter))
    assert s["elastic_trainer_train_step"] == 3
    assert s["elastic_trainer_world_size"] == 1
    assert s["elastic_trainer_train_samples_total"] == 80
    assert s["elastic_trainer_train_step_duration_seconds_count"] == 1
    assert s["elastic_trainer_checkpoint_last_committed_step"] == 5
    w0.exit()


def test_unknown_and_mistyped_metrics_are_dropped_with_one_warning(caplog):
    from elastic_trainer.metrics.prometheus import PrometheusSink

    sink = PrometheusSink(frozenset({"global"}), rank=0)
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.metrics.prometheus"):
        sink.gauge("elastic_trainer_no_such_metric", 1)
        sink.gauge("elastic_trainer_no_such_metric", 2)
        sink.counter("elastic_trainer_train_loss", 1)
        sink.histogram("elastic_trainer_restarts_total", 1)  # wrong type, and another process's
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("elastic_trainer_no_such_metric" in m for m in msgs) == 1
    assert any("elastic_trainer_train_loss" in m and "gauge" in m for m in msgs)
    assert any("elastic_trainer_restarts_total" in m and "counter" in m for m in msgs)


def _status(exp, headers: dict) -> tuple[int, str]:
    host, port = exp.address
    req = urllib.request.Request(f"http://{host}:{port}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_endpoint_answers_only_requests_with_the_jobs_token(exporter):
    """No credentials, another token, the token in another scheme or with a suffix: 401 and no
    metric in the answer; ``Bearer <token>``: the exposition."""
    token = runs.METRICS_TOKEN
    for headers in (
        {},
        {"Authorization": "Bearer not-the-token"},
        {"Authorization": f"Basic {token}"},
        {"Authorization": f"Bearer {token}x"},
        {"Authorization": token},
    ):
        code, body = _status(exporter, headers)
        assert code == 401 and "elastic_trainer_" not in body, (headers, code, body)
    code, body = _status(exporter, {"Authorization": f"Bearer {token}"})
    assert code == 200 and "elastic_trainer_restarts_total" in body


def test_a_connection_that_sends_nothing_is_closed_and_scrapes_go_on(exporter, monkeypatch):
    """Idle connections (which need no token to open) are closed after ``IDLE_SECONDS``, not held
    forever on a thread each; a scrape meanwhile is answered."""
    assert prometheus._QuietHandler.timeout == prometheus.IDLE_SECONDS <= 30
    monkeypatch.setattr(prometheus._QuietHandler, "timeout", 0.5)  # the same mechanism, faster
    host, port = exporter.address
    idle = [socket.create_connection((host, port), timeout=10) for _ in range(3)]
    try:
        code, _ = _status(exporter, {"Authorization": f"Bearer {runs.METRICS_TOKEN}"})
        assert code == 200
        t0 = time.monotonic()
        for sock in idle:
            assert sock.recv(1024) == b"", "the server closes an idle connection"
        assert time.monotonic() - t0 < 5
    finally:
        for sock in idle:
            sock.close()


def test_without_a_token_set_the_node_makes_one_readable_by_its_owner_alone(tmp_path, monkeypatch, caplog):
    """``ELASTIC_TRAINER_METRICS_TOKEN`` unset: a random token in ``metrics.token`` (mode 0600)
    beside the metrics files, which the endpoint takes and which is never logged; set with the
    newline a Secret file ends in: the token without it."""
    from prometheus_client import values

    original = values.ValueClass
    for i, (env, want) in enumerate(((None, None), ("  from-a-secret-file\n", "from-a-secret-file"))):
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
        if env is None:
            monkeypatch.delenv(contract.METRICS_TOKEN_ENV, raising=False)
        else:
            monkeypatch.setenv(contract.METRICS_TOKEN_ENV, env)
        cfg = Config(
            run=RunConfig(dir=str(tmp_path / f"run{i}")), metrics=MetricsConfig(port=free_port(), host="127.0.0.1")
        )
        try:
            with caplog.at_level(logging.DEBUG):
                exp = factory.start_supervisor_exporter(cfg)
            path = Path(exp.path).parent / "metrics.token"
            if want is None:
                want = path.read_text().strip()
                assert len(want) >= 32 and (path.stat().st_mode & 0o777) == 0o600
                assert str(path) in caplog.text
            else:
                assert not path.exists()
            assert want not in caplog.text, "the token is never logged"
            assert _status(exp, {"Authorization": f"Bearer {want}"})[0] == 200
            assert _status(exp, {})[0] == 401
            exp.stop()
        finally:
            values.ValueClass = original
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def test_port_in_use_logs_and_training_goes_on(tmp_path, monkeypatch, caplog):
    import socket

    from prometheus_client import values

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    original = values.ValueClass
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        cfg = Config(
            run=RunConfig(dir=str(tmp_path)), metrics=MetricsConfig(port=busy.getsockname()[1], host="127.0.0.1")
        )
        try:
            with caplog.at_level(logging.ERROR):
                exp = factory.start_supervisor_exporter(cfg)
            assert exp.address is None
            exp.sink.counter("elastic_trainer_restarts_total")
            exp.stop()
        finally:
            values.ValueClass = original
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    assert any("not started" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- every metric, promtool, dashboard


def _value_for(m: catalog.Metric) -> float:
    return 1.5 if m.type == catalog.HISTOGRAM else 3.0


@pytest.fixture
def full_exposition(exporter) -> str:
    """The exposition after every catalogue metric has been recorded by the process that owns it."""
    kind = {catalog.GAUGE: "gauge", catalog.COUNTER: "counter", catalog.HISTOGRAM: "histogram"}

    def call(m):
        extra = {k: "x" for k in m.labels if k != "rank"}
        return [kind[m.type], m.name, _value_for(m)] + ([extra] if extra else [])

    worker_calls = [call(m) for m in catalog.CATALOG if m.scope != "supervisor"]
    for m in catalog.CATALOG:
        if m.scope == "supervisor":
            getattr(exporter.sink, kind[m.type])(*call(m)[1:])
    w = Worker(0, worker_calls)
    try:
        return scrape(exporter)
    finally:
        w.exit()


def test_every_catalogue_metric_is_exported(full_exposition):
    names = {k.split("{")[0] for k in samples(full_exposition)}
    assert names == catalog.exported_sample_names()
    lines = set(full_exposition.splitlines())
    for m in catalog.CATALOG:
        families = {m.name, m.name.removesuffix("_total")}  # counters: either form of the family name
        assert any(f"# HELP {f} {m.help}" in lines for f in families), m.name
        assert any(f"# TYPE {f} {m.type}" in lines for f in families), m.name


def test_promtool_check_metrics_passes(full_exposition, promtool):
    r = subprocess.run(
        [promtool, "check", "metrics"], input=full_exposition, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, f"promtool check metrics failed:\n{r.stdout}{r.stderr}"


def dashboard_queries(dash: dict) -> list[str]:
    """Every PromQL expression in a Grafana dashboard (panels, nested rows, annotations) and the
    metric of each ``label_values(metric, label)`` template query."""
    out = []

    def panels(ps):
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dash.get("panels", [])):
        out += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
    out += [a["expr"] for a in dash.get("annotations", {}).get("list", []) if a.get("expr")]
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", q or "")
        if m:
            out.append(m.group(1))
    return out


GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "$job": ".*", "$run": ".*"}
_KEYWORDS = {"and", "or", "unless", "bool", "inf", "nan"}


def substitute(expr: str) -> str:
    for k in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(k, GRAFANA_VARS[k])
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (a small lexer: drops strings, label matchers,
    ranges, grouping clauses, offsets, function and aggregation names)."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', "", expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\boffset\s+\S+", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        rest = e[m.end() :].lstrip()
        if rest.startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue
        if m.start() > 0 and (e[m.start() - 1].isdigit() or e[m.start() - 1] == "."):
            continue  # 1e3, 0.5
        names.add(m.group(0))
    return names


def test_metric_name_lexer():
    assert metric_names('histogram_quantile(0.95, sum by (job, le) (rate(a_bucket{job=~"$job"}[5m])))') == {"a_bucket"}
    assert metric_names("time() - max by (job) (b) > 3600") == {"b"}
    assert metric_names("sum(rate(c[10m])) < 0.5 * sum(rate(c[1h] offset 10m)) and on (job) d > 0") == {"c", "d"}


def test_dashboard_queries_name_only_exported_metrics(full_exposition):
    dash = json.loads(DASHBOARD.read_text())
    exported = {k.split("{")[0] for k in samples(full_exposition)}
    queries = dashboard_queries(dash)
    assert len(queries) > 20
    used = set()
    for q in queries:
        names = metric_names(q)
        assert names, f"no metric in {q!r}"
        assert names <= exported, f"{q!r} names {sorted(names - exported)}, which the exporter does not export"
        used |= names
    for needed in (
        "elastic_trainer_train_tokens_total",
        "elastic_trainer_train_loss",
        "elastic_trainer_checkpoint_stall_seconds_bucket",
        "elastic_trainer_checkpoint_last_commit_timestamp_seconds",
        "elastic_trainer_restarts_total",
        "elastic_trainer_world_size",
        "elastic_trainer_train_nonfinite_events_total",
    ):
        assert needed in used, f"the dashboard has no panel on {needed}"


def test_alert_rules_name_only_exported_metrics(full_exposition):
    import yaml

    exported = {k.split("{")[0] for k in samples(full_exposition)}
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    for r in rules:
        names = metric_names(str(r["expr"]))
        assert names and names - {"up"} <= exported, f"{r['alert']}: {sorted(names - exported)} not exported"


def test_dashboard_queries_parse_as_promql(tmp_path, promtool):
    """promtool parses every dashboard query (as recording rules, Grafana variables filled in)."""
    import yaml

    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:query_{i}", "expr": substitute(q)} for i, q in enumerate(queries)],
            }
        ]
    }
    f = tmp_path / "dashboard_rules.yml"
    f.write_text(yaml.safe_dump(rules))
    r = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{r.stdout}{r.stderr}"
