"""Benchmarks that cannot rot: every script in bench/ runs its smoke mode (tiny sizes, one repeat).

A script whose smoke run fails no longer runs, and its figures in BENCHMARKS.md can no longer be
re-measured. Adding a script to bench/ is one line in :data:`SMOKE` (its arguments); a script
missing from it fails :func:`test_every_bench_script_has_a_smoke_run`.
"""

import subprocess
import sys
import time

import pytest

from tests import runs

BENCH = runs.REPO / "bench"
# imported by the scripts (step_probe through step_phases.py, checkpoint_peers through checkpoint_stall.py,
# scale_keyed through scale.py --keyed, which its smoke run takes)
HELPERS = {"common.py", "step_probe.py", "checkpoint_peers.py", "scale_keyed.py"}
ELSEWHERE = {"gpu_check.py": "tests/e2e/test_gpu_check.py"}  # its --device cpu dry run has tests of its own

# script -> its smoke command's arguments; each one's smoke mode skips what this machine lacks
# (py-spy, network namespaces) and optional peers (torchtitan)
SMOKE: dict[str, list[str]] = {
    "accelerate_checkpoint.py": ["--smoke"],
    "audit_cost.py": ["--smoke", "--flip-at", "3"],
    "checkpoint_stall.py": ["--smoke"],
    "core_interference.py": ["--smoke"],
    "goodput.py": ["--smoke"],
    "goodput_at_scale.py": ["--smoke"],
    "integrity.py": ["--smoke"],
    "ledger_scale.py": ["--smoke"],
    "lightning_checkpoint.py": ["--smoke"],
    "local_tier.py": ["--smoke"],
    "netcluster.py": ["--smoke"],
    "peer_recovery.py": ["--smoke"],
    "recovery.py": ["--smoke"],
    "run_recovery.py": ["--smoke"],
    "s3_throughput.py": ["--smoke"],
    "shm_rewrite.py": ["--smoke"],
    "save_gil.py": ["--smoke"],
    "scale.py": ["--smoke"],
    "step_phases.py": ["--smoke"],
    "throughput.py": ["--smoke"],
    "transformers_trainer.py": ["--smoke"],
    "write_cost.py": ["--smoke"],
}
# smoke runs that train on a cluster or start a framework's workers several times (about 13 s and
# more; what they run is covered by the e2e tests of the same paths): soak only
SOAK = {
    "audit_cost.py",
    "local_tier.py",
    "peer_recovery.py",
    "lightning_checkpoint.py",
    "accelerate_checkpoint.py",
    "run_recovery.py",
    "transformers_trainer.py",
}


def test_every_bench_script_has_a_smoke_run():
    scripts = {p.name for p in BENCH.glob("*.py")} - HELPERS - set(ELSEWHERE)
    assert all((runs.REPO / test).exists() for test in ELSEWHERE.values())
    assert scripts == set(SMOKE), (
        f"bench scripts without a smoke run: {sorted(scripts - set(SMOKE))}; "
        f"smoke runs of scripts that are gone: {sorted(set(SMOKE) - scripts)}"
    )


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.soak) if s in SOAK else s for s in sorted(SMOKE)])
def test_bench_script_smoke_run(script, tmp_path):
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, str(BENCH / script), *SMOKE[script]],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=runs.REPO,
        env=runs.env_for_tests(),
    )
    print(f"{script} --smoke: {time.monotonic() - t0:.1f}s")
    assert r.returncode == 0, f"{script} no longer runs:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
