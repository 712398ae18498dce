"""Operations view end to end, scraped by a real Prometheus (issue #13):

* a 2-worker run with rank 1 slowed on purpose (fault ``slow``) and rank 0 SIGKILLed after a
  commit: the straggler panel's query names rank 1; the live goodput metrics scraped by
  Prometheus agree with ``report`` on the same events within 1 %, every category the run had is
  non-zero; after ``run.dir`` is deleted, ``report`` on the checkpoint root gives the same summary;
* two concurrent runs scraped by one Prometheus stay separate in every dashboard query.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_trainer.goodput import CATEGORIES, Ledger
from tests import runs
from tests.fixtures.procs import free_port
from tests.unit.test_metrics_exporter import DASHBOARD, dashboard_queries, substitute

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(240)]

STEPS = 30


def _panel_query(title: str) -> str:
    [p] = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == title]
    return p["targets"][0]["expr"]


def _report(target: str) -> dict:
    r = subprocess.run(
        [*runs.CLI, "report", target, "--json", "--out", str(Path(target).parent / f"{Path(target).name}.png")],
        capture_output=True,
        text=True,
        timeout=120,
        env=runs.env_for_tests(),
        cwd=runs.REPO,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_goodput_straggler_and_history_through_prometheus(tmp_path, token_file, prometheus_server):
    port = free_port()
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    config = runs.write_config(
        tmp_path / "run.toml",
        token_file,
        run_dir,
        str(ckpt),
        run={"name": "ops-a"},
        model={"seq_len": 128, "dim": 128, "n_layers": 4, "n_heads": 4},
        train={"steps": STEPS, "global_batch_size": 16, "micro_batch_size": 4, "log_every": 10},
        checkpoint={"interval_steps": 10},
        elastic={"max_restarts": 1},
        metrics={"port": port, "host": "127.0.0.1"},
    )
    prom = prometheus_server([f"127.0.0.1:{port}"])
    sup = runs.start_launch(config, env={"ELASTIC_TRAINER_INJECT_FAULT": "slow@rank=1,step=1,seconds=0.25"})
    try:
        runs.wait_event(run_dir, "checkpoint_committed", 90, sup)
        # 1. The straggler panel names the slowed rank.
        slowest = substitute(_panel_query("Slowest rank vs median"))
        runs.wait_for(lambda: prom.query(slowest), 20, "the straggler query to have data", sup)
        [row] = prom.query(slowest)
        assert row["metric"]["rank"] == "1" and row["metric"]["run"] == "ops-a", row
        assert float(row["value"][1]) > 1.05, row  # with 2 ranks the median is their mean: at most 2
        assert prom.value('max(elastic_trainer_build_info{run="ops-a"})') == 1
        assert prom.value('max(elastic_trainer_world_size_expected{run="ops-a"})') == 2

        # 2. A failure after the commit: rank 0 SIGKILLed; the job resumes and finishes.
        # steps after the commit of 10 will be redone
        runs.wait_event(run_dir, "step", 60, sup, where=lambda e: e["step"] >= 13)
        first = runs.read_events(run_dir, "start")[0]
        os.kill(first["pid"], signal.SIGKILL)
        runs.wait_event(run_dir, "resume", 60, sup)
        runs.wait_event(run_dir, "step", 60, sup, where=lambda e: e["step"] == STEPS)
        time.sleep(1.5)  # a scrape after the last step
        assert sup.wait(timeout=90) == 0, runs.read_events(run_dir, "failure")
    finally:
        runs.stop(sup)

    # 3. The last scrape of the live ledger against the accounting of the same events.
    data = prom.api("/api/v1/query", query='elastic_trainer_wall_seconds{run="ops-a"}[10m]', time=str(time.time()))[
        "result"
    ]
    last_ts = min(float(s["values"][-1][0]) for s in data)
    live = {
        s["metric"]["category"]: float(next(v for t, v in reversed(s["values"]) if float(t) <= last_ts)) for s in data
    }
    assert set(live) == set(CATEGORIES)
    ledger = Ledger()
    for e in runs.read_events(run_dir):
        if e["time"] <= last_ts:
            ledger.feed(e)
    ref = ledger.result(now=last_ts)
    wall = sum(live.values())
    assert abs(wall - ref.wall_seconds) <= 0.01 * ref.wall_seconds, (wall, ref.wall_seconds)
    # An event stamped before the last scrape can reach the file just after it (rank 0's after its
    # step, the commit thread's): the live ledger had not read it yet, so up to one step's time may
    # sit in another category there than in the replay of the same events.
    lag = max(e["step_time_s"] for e in runs.read_events(run_dir, "step") if e.get("step_time_s"))
    for cat in CATEGORIES:
        assert abs(live[cat] - ref.categories[cat]) <= 0.01 * ref.wall_seconds + lag, (
            cat,
            live[cat],
            ref.categories[cat],
            lag,
        )
    ratio = prom.api("/api/v1/query", query='elastic_trainer_goodput_ratio{run="ops-a"}[10m]', time=str(time.time()))[
        "result"
    ][0]["values"]
    g_live = float(next(v for t, v in reversed(ratio) if float(t) <= last_ts))
    assert abs(g_live - ref.goodput) <= 0.01 + lag / ref.wall_seconds, (g_live, ref.goodput, lag)
    for cat in ("productive", "recompute", "restart", "rendezvous", "startup", "checkpoint_load", "checkpoint_stall"):
        assert live[cat] > 0, (cat, live)
    final = _report(str(run_dir))
    # The final report also counts the time after the last scrape (the last steps, the exit),
    # which can move the ratio by at most that share of the wall time.
    tail = max(0.0, final["goodput"]["wall_seconds"] - ref.wall_seconds) / final["goodput"]["wall_seconds"]
    assert abs(final["goodput"]["goodput"] - g_live) <= tail + 0.01, (
        "the final report is close to the last scrape too",
        tail,
    )

    # 4. run.dir deleted: the report from the checkpoint root is the same.
    shutil.rmtree(run_dir)
    assert [p.name for p in (ckpt / "_events").iterdir()], "the supervisor mirrored its event log"
    again = _report(str(ckpt))
    for k in ("run_dir", "plot", "events"):
        final.pop(k), again.pop(k)
    assert again == final


# A stand-in node: its supervisor exporter plus a rank-0 worker sink recording every catalogue
# metric once (counters twice, so rates exist), for run RUN on PORT.
NODE = r"""
import os, sys, time
from elastic_trainer.config import Config, MetricsConfig, RunConfig
from elastic_trainer.metrics import catalog, factory
from elastic_trainer.metrics.prometheus import PrometheusSink
run, port, d = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = Config(run=RunConfig(dir=d, name=run), metrics=MetricsConfig(port=port, host="127.0.0.1"))
exp = factory.start_supervisor_exporter(cfg)
worker = PrometheusSink(frozenset({"global", "rank"}), rank=0, run=run)
i = 0
while True:  # until the test terminates it
    for m in catalog.CATALOG:
        sink = exp.sink if m.scope == "supervisor" else worker
        labels = {k: "x" for k in m.labels if k != "rank"}
        if m.type == catalog.GAUGE:
            sink.gauge(m.name, 1.0 + i, labels or None)
        else:
            getattr(sink, m.type)(m.name, 1.0)
    if i == 0:
        print("ready", flush=True)
    i += 1
    time.sleep(0.5)
"""


def test_two_concurrent_runs_stay_separate_in_every_dashboard_query(tmp_path, prometheus_server):
    ports = [free_port(), free_port()]
    nodes = []
    try:
        for name, port in zip(("run-a", "run-b"), ports, strict=True):
            p = subprocess.Popen(
                [sys.executable, "-c", NODE, name, str(port), str(tmp_path / name)],
                stdout=subprocess.PIPE,
                env=runs.env_for_tests(),
                text=True,
            )
            nodes.append(p)
            assert p.stdout.readline().strip() == "ready"
        prom = prometheus_server([f"127.0.0.1:{p}" for p in ports])
        runs.wait_for(
            lambda: prom.value("count(rate(elastic_trainer_train_tokens_total[1m]) > 0)") == 2,
            30,
            "both runs' counters to rise",
        )
        for q in dashboard_queries(json.loads(DASHBOARD.read_text())):
            if q.startswith("elastic_trainer_rendezvous_rounds_total"):
                continue  # the template variable's bare metric
            res = prom.query(substitute(q))
            assert res, f"no data for {q}"
            runs_seen = [r["metric"].get("run") for r in res]
            assert set(runs_seen) == {"run-a", "run-b"}, (q, res)
    finally:
        for p in nodes:
            p.terminate()
            p.wait(timeout=20)
