"""End to end: a real Prometheus server scrapes a real 2-worker training run.

Prometheus (scrape interval 1 s, the alert rules loaded) scrapes the supervisor's endpoint; the
test reads loss, step, world size and checkpoint metrics back through Prometheus's query API,
SIGKILLs rank 0 after a checkpoint commit, and sees the restart counter rise while the job
resumes and finishes. The live exposition passes ``promtool check metrics``, every dashboard
query evaluates in Prometheus, and ``elastic-trainer report`` draws the run with its restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests import runs
from tests.fixtures.procs import free_port
from tests.unit.test_metrics_exporter import DASHBOARD, dashboard_queries, substitute

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(180)]

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
STEPS = 30


def test_prometheus_scrapes_a_run_through_a_worker_kill(tmp_path, token_file, prometheus_server, promtool):
    port = free_port()
    run_dir = tmp_path / "run"
    config = runs.write_config(
        tmp_path / "run.toml",
        token_file,
        run_dir,
        # Big enough for ~0.1-0.3 s steps, so a 1 s scrape interval sees the run progress.
        model={"seq_len": 128, "dim": 128, "n_layers": 4, "n_heads": 4},
        train={"steps": STEPS, "global_batch_size": 16, "micro_batch_size": 4, "log_every": 10},
        checkpoint={"interval_steps": 10},
        elastic={"max_restarts": 1},
        metrics={"port": port, "host": "127.0.0.1"},
    )
    prom = prometheus_server([f"127.0.0.1:{port}"], rule_files=[ALERTS])
    # The first incarnation slows down after its first commit, so it is still running (its live
    # gauges exported) while the test reads it and kills it, however fast the machine's steps are.
    sup = runs.start_launch(config, env={"ELASTIC_TRAINER_INJECT_FAULT": "slow@rank=0,step=11,seconds=0.4"})
    try:
        # 1. Training metrics arrive through Prometheus.
        runs.wait_event(run_dir, "checkpoint_committed", 60, sup)
        assert prom.wait_value("elastic_trainer_checkpoint_last_committed_step", lambda v: v >= 10, 15) >= 10
        assert prom.wait_value("elastic_trainer_world_size", lambda v: v == 2, 20) == 2
        step = prom.wait_value("elastic_trainer_train_step", lambda v: v >= 1, 10)
        loss = prom.value("elastic_trainer_train_loss")
        assert loss is not None and 0 < loss < 10
        assert prom.value("time() - elastic_trainer_checkpoint_last_commit_timestamp_seconds") < 60
        assert prom.value("elastic_trainer_checkpoint_written_bytes_total") > 0
        assert prom.value("elastic_trainer_train_step_duration_seconds_count") >= step - 1
        assert prom.value("elastic_trainer_restarts_total") == 0
        assert prom.value("elastic_trainer_rendezvous_rounds_total") == 1
        # Prometheus sends the job's token (tests/fixtures/prometheus.py); a request without it gets nothing
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert refused.value.code == 401
        ranks = {r["metric"]["rank"] for r in prom.query("elastic_trainer_process_resident_memory_bytes")}
        assert ranks == {"0", "1"}

        # 2. SIGKILL rank 0 of the first incarnation; the supervisor restarts the group.
        first = runs.read_events(run_dir, "start")[0]
        assert first["restart_count"] == 0
        samples_before = prom.value("elastic_trainer_train_samples_total")
        os.kill(first["pid"], signal.SIGKILL)
        runs.wait_event(run_dir, "restart", 30, sup)
        resume = runs.wait_event(run_dir, "resume", 60, sup)
        assert prom.wait_value("elastic_trainer_restarts_total", lambda v: v >= 1, 15) == 1
        assert prom.wait_value("elastic_trainer_rendezvous_rounds_total", lambda v: v >= 2, 10) == 2
        assert prom.value("elastic_trainer_recovery_seconds_count") == 1
        after = prom.wait_value(
            "elastic_trainer_train_step", lambda v: v > resume["step"], 20, "a step after the resume"
        )
        assert after > resume["step"]
        assert prom.value("elastic_trainer_train_samples_total") >= samples_before, "counters survive the restart"
        assert prom.value("increase(elastic_trainer_restarts_total[1m])") > 0

        # 3. The live exposition is valid, and every dashboard query evaluates in Prometheus.
        exposition = runs.scrape(port)
        check = subprocess.run(
            [promtool, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=60
        )
        assert check.returncode == 0, check.stdout + check.stderr
        for q in dashboard_queries(json.loads(DASHBOARD.read_text())):
            prom.query(substitute(q))  # raises unless Prometheus answers "success"
        assert prom.query(
            substitute('sum by (job) (rate(elastic_trainer_train_tokens_total{job=~"$job"}[$__rate_interval]))')
        )
        rules = [r for g in prom.rules() for r in g["rules"]]
        assert len(rules) >= 4 and all(r["health"] == "ok" for r in rules), rules

        # 4. The job finishes.
        assert sup.wait(timeout=90) == 0, runs.read_events(run_dir, "failure")
    finally:
        runs.stop(sup)

    # 5. The report of the run shows the restart and the whole loss curve.
    png = tmp_path / "report.png"
    r = subprocess.run(
        [*runs.CLI, "report", str(run_dir), "--out", str(png), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=runs.env_for_tests(),
        cwd=runs.REPO,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert (summary["status"], summary["steps"], summary["restarts"]) == ("finished", STEPS, 1)
    assert summary["checkpoints_committed"] >= STEPS // 10
    [interruption] = summary["goodput"]["interruptions"]
    assert interruption["reason"] == "worker_failure" and interruption["resumed_step"] == resume["step"]
    assert 0 < summary["goodput"]["goodput"] < 1
    from elastic_trainer.report import kept_steps

    kept = kept_steps(runs.read_events(run_dir))
    assert [e["step"] for e in kept] == list(range(1, STEPS + 1)), "one continuous loss curve across the resume"
