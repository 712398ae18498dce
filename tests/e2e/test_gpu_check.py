"""bench/gpu_check.py's ``--device cpu`` dry run: the script the GPU machines run keeps working.

The dry run trains on 2 gloo ranks at reduced sizes; CI runs the reshard step (a world-2 demo run,
a world-2 run killed after a save, its world-1 resume within 1e-5 of the uninterrupted run) and one
integration step; a spent time budget fails the steps that need it and the others still run."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.runs import REPO, env_for_tests

SCRIPT = REPO / "bench" / "gpu_check.py"


def _check(out, *args) -> tuple[int, dict, str]:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env_for_tests(),
        cwd=REPO,
    )
    report = json.loads((out / "gpu_check.json").read_text())
    return r.returncode, report, (out / "gpu_check.md").read_text()


def test_dry_run_reshards_and_reports_every_step(tmp_path):
    # one integration step: lightning's runs the same example-under-run helper as accelerate's
    rc, report, md = _check(tmp_path, "--steps", "reshard,accelerate")
    steps = {s["step"]: s for s in report["steps"]}
    assert rc == 0 and all(s["status"] == "passed" for s in steps.values()), json.dumps(report["steps"])[-3000:]
    assert (report["device"], report["world"]) == ("cpu", 2)
    reshard = steps["reshard"]
    assert reshard["status"] == "passed" and reshard["result"]["max_loss_rel_diff"] <= 1e-5, reshard
    # the example under run, on the device: it trained and committed
    assert steps["accelerate"]["result"]["commits"] >= 1, steps["accelerate"]
    # its workers were forked from the zygote, which took the example's imported names
    assert steps["accelerate"]["result"]["warm"] is True, steps["accelerate"]
    for name in steps:
        assert f"| {name} | {steps[name]['status']} |" in md


def test_a_failed_step_is_reported_and_the_rest_still_run(tmp_path):
    rc, report, md = _check(tmp_path, "--steps", "demo,lightning", "--budget-seconds", "0")
    demo, lightning = report["steps"]
    assert rc == 1
    assert demo["status"] == "failed" and "time budget" in demo["error"], demo
    assert lightning["status"] == "failed" and "time budget" in lightning["error"], lightning  # tried, not skipped
    assert "| demo | failed |" in md
