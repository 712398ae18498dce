"""Trustworthy checkpoints end to end (issue #10): supervisor + 2 gloo workers + async DCP.

* Preemption at each point of a restart (during load, before the first step, mid-step, during
  an async save) with ``keep_last = 1``: a committed checkpoint exists afterwards (checked in
  storage) and the exit code is 75 exactly when the final step is committed.
* Same-size corruption of a shard, of ``.metadata`` and of the manifest of the newest checkpoint:
  detected, the resume falls back to the previous commit, losses from there bitwise equal.
* A NaN at step k: ``stop`` exits 65 with nothing committed after the last finite step;
  ``rollback`` skips the sample range and finishes, a second NaN before a save stops.
* Two launches on one root: the older one is fenced (exit 73), the newer goes on; a
  kill-and-relaunch resumes at once; every step's loss equals the uninterrupted run's.
* ``ELASTIC_TRAINER_CHECKPOINT_KEY``: a forged ``.metadata`` with a matching, re-checksummed but
  unsigned manifest is refused before it is unpickled (resume and ``ckpt inspect``).
* Slow storage (S3 through a delaying proxy, longer than the hang timeout): no worker is killed
  as hung, training goes on.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elastic_trainer.checkpoint import layout
from elastic_trainer.checkpoint.catalog import Catalog, lineage
from elastic_trainer.storage.fs import open_storage
from tests import runs

STEPS = 12
BASE = {"train": {"steps": STEPS}, "checkpoint": {"interval_steps": 3, "keep_last": 2}}
TIMEOUT = 240

pytestmark = pytest.mark.timeout(600)


def _config(
    tmp_path: Path, token_file: str, name: str, run: Path | None = None, ckpt_dir: str | None = None, **sections
) -> tuple[Path, Path]:
    merged = {k: dict(v) for k, v in BASE.items()}
    for k, v in sections.items():
        merged.setdefault(k, {}).update(v)
    run = run or tmp_path / name
    return runs.write_config(tmp_path / f"{name}.toml", token_file, run, ckpt_dir, **merged), run


def _log(cfg: Path) -> str:
    return cfg.with_suffix(".log").read_text()[-4000:]


def _valid_commits(root: Path, key: bytes | None = None) -> dict[int, str]:
    """Step -> directory of every valid commit in storage (newest directory per step)."""
    cat = Catalog(open_storage(str(root)), key=key)
    return {c.step: c.name for c in sorted(cat.scan(), key=lambda c: (c.step, c.gen)) if cat.problem(c) is None}


def _bytes_match_manifest(d: Path, manifest: dict) -> bool:
    """Every file of a commit hashes to what its manifest says (a full re-read, unlike verify)."""
    return all(layout.digest((d / rel).read_bytes()) == int(f["xxh3"]) for rel, f in manifest["files"].items())


def _head(root: Path, key: bytes | None = None):
    return Catalog(open_storage(str(root)), key=key).head()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, token_file) -> Path:
    """Uninterrupted: 12 steps at world 2, a save every 3 steps, the last 2 kept (9 and 12)."""
    d = tmp_path_factory.mktemp("trust-ref")
    cfg, run = _config(d, token_file, "ref")
    r = runs.run_launch(cfg, timeout=TIMEOUT)
    assert r.returncode == 0, _log(cfg)
    assert sorted(runs.step_losses(run)) == list(range(1, STEPS + 1))
    assert sorted(_valid_commits(run / "ckpt")) == [9, 12]
    return run


# ---------------------------------------------------------------------------- preemption
# Bounded suite: mid-step and mid-save; the load and before-the-first-step points are soak
# (test_chaos kills a rank during a load in every run).
POINTS = [
    pytest.param("during_load", marks=pytest.mark.soak),
    pytest.param("before_first_step", marks=pytest.mark.soak),
    "mid_step",
    "during_async_save",
]


@pytest.mark.parametrize("point", POINTS)
def test_preemption_at_each_point_of_a_restart_commits_and_exits_truthfully(point, tmp_path, token_file):
    """Rank 1 is SIGKILLed at the start of step 6, once step 3 is committed; the agent restarts the
    group, which resumes from 3. The supervisor gets SIGTERM at ``point`` of that restart."""
    cfg, run = _config(tmp_path, token_file, "run", checkpoint={"keep_last": 1}, elastic={"max_restarts": 1})
    sup = runs.start_launch(cfg, env={"ELASTIC_TRAINER_INJECT_FAULT": "kill@rank=1,step=6,committed=3"})
    try:
        if point == "during_load":
            runs.wait_event(run, "start", TIMEOUT, sup, where=lambda r: r["restart_count"] == 1)
        else:
            resume = runs.wait_event(run, "resume", TIMEOUT, sup)
            assert resume["step"] == 3
            if point == "mid_step":  # step 4 is not a save step: the next one must commit 4 or later
                runs.wait_event(
                    run, "step", TIMEOUT, sup, where=lambda r: r["step"] == 4 and r["time"] >= resume["time"]
                )
            elif point == "during_async_save":  # the async save of step 6 is in flight
                runs.wait_event(
                    run, "step", TIMEOUT, sup, where=lambda r: r["step"] == 6 and r["time"] >= resume["time"]
                )
        sup.send_signal(signal.SIGTERM)
        code = sup.wait(timeout=120)
    finally:
        runs.stop(sup)
    log = _log(cfg)
    (restart,) = runs.read_events(run, "restart")
    assert runs.read_events(run, "resume")[-1]["step"] == 3 or point == "during_load", log
    (pre,) = [e for e in runs.read_events(run, "preempted") if e["time"] >= restart["time"]]
    commits = _valid_commits(run / "ckpt")
    head = _head(run / "ckpt")
    # A committed checkpoint exists afterwards, and the exit code tells the truth about it.
    assert head is not None, f"no committed checkpoint left after preemption {point}\n{log}"
    assert code == (75 if pre["committed"] else 76), (code, pre, log)
    assert code == 75, f"the final step {pre['step']} should have been committed at {point}: {pre}\n{log}"
    assert pre["step"] in commits and head.step == pre["step"], (pre, commits)
    assert sorted(commits) == [pre["step"]], f"keep_last = 1: {commits}"
    if point == "during_load":
        assert pre["step"] == 3, f"the signal came during the load, yet step {pre['step']} ran"
    if point == "before_first_step":
        assert pre["step"] in (3, 4), pre  # the signal races the first step (it may have begun)
    if pre["step"] == 3:
        # Preempted right after resuming: the loaded checkpoint is the final one. It must not be
        # deleted or rewritten (a save of the loaded step is a no-op).
        assert commits[3] == "step-00000003", commits
        assert not any(
            e["step"] == 3 and e["time"] >= restart["time"] for e in runs.read_events(run, "checkpoint_deleted")
        )
        assert not [e for e in runs.read_events(run, "checkpoint_committed") if e["time"] >= restart["time"]]
    marker = json.loads((run / "PREEMPTED").read_text())
    assert marker["exit_code"] == 75 and marker["step"] == pre["step"]


# ---------------------------------------------------------------------------- corruption
def _corrupt_shard(d: Path) -> None:
    shard = d / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    shard.write_bytes(bytes(data))


def _corrupt_metadata(d: Path) -> None:
    meta = d / ".metadata"
    data = bytearray(meta.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0x5A for b in data[mid : mid + 16])
    meta.write_bytes(bytes(data))


def _corrupt_manifest(d: Path) -> None:
    path = d / layout.MANIFEST
    text = path.read_text()
    i = text.index('"total_bytes": ') + len('"total_bytes": ')
    new = text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1 :]
    json.loads(new)
    path.write_text(new)


CORRUPTIONS = {"shard": _corrupt_shard, "metadata": _corrupt_metadata, "manifest": _corrupt_manifest}


# The shard case runs in every run; the other two differ only in which check finds the damage,
# which tests/unit/test_catalog.py and test_integrity.py cover for every file kind (soak here).
@pytest.mark.parametrize(
    "what", [pytest.param(w, marks=pytest.mark.soak) if w != "shard" else w for w in sorted(CORRUPTIONS)]
)
def test_same_size_corruption_of_the_newest_checkpoint_falls_back_bitwise(what, tmp_path, token_file, reference):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "events.jsonl").unlink()
    newest = run / "ckpt" / "step-00000012"
    sizes = {p.name: p.stat().st_size for p in newest.iterdir()}
    CORRUPTIONS[what](newest)
    assert {p.name: p.stat().st_size for p in newest.iterdir()} == sizes, "same-size corruption"
    cfg, _ = _config(tmp_path, token_file, "again", run=run)
    r = runs.run_launch(cfg, timeout=TIMEOUT)
    assert r.returncode == 0, _log(cfg)
    skipped = [e for e in runs.read_events(run, "checkpoint_skipped") if e["step"] == 12]
    assert skipped, runs.read_events(run, "checkpoint_skipped")
    reason = " ".join(e["reason"] for e in skipped)
    if what == "manifest":
        assert "manifest checksum mismatch" in reason, reason
    else:
        assert "checksum mismatch" in reason and (
            "before unpickling" in reason if what == "metadata" else "corrupted shard" in reason
        ), reason
    # Quarantined (a marker, never a deletion), whether the manifest's seal or a data checksum broke.
    q = json.loads((newest / layout.QUARANTINE).read_text())
    assert "checksum mismatch" in q["reason"]
    (qe,) = runs.read_events(run, "checkpoint_quarantined")
    assert qe["step"] == 12 and qe["name"] == "step-00000012"
    assert newest.exists(), "a damaged commit is kept as evidence, never deleted"
    (resume,) = runs.read_events(run, "resume")
    assert resume["step"] == 9
    ref = runs.step_losses(reference)
    assert runs.step_losses(run) == {s: ref[s] for s in range(10, STEPS + 1)}
    # The new commit of 12 got a directory of its own; keep_last = 2 kept 9 (its parent).
    commits = _valid_commits(run / "ckpt")
    assert commits == {9: "step-00000009", 12: "step-00000012.1"}, commits


# ---------------------------------------------------------------------------- non-finite
def _nan_run(tmp_path, token_file, fault: str, mode: str):
    cfg, run = _config(tmp_path, token_file, "run", train={"on_nonfinite": mode}, elastic={"max_restarts": 1})
    r = runs.run_launch(cfg, timeout=TIMEOUT, env={"ELASTIC_TRAINER_INJECT_FAULT": fault})
    return cfg, run, r.returncode


def test_nan_with_stop_exits_65_and_commits_nothing_after_the_last_finite_step(tmp_path, token_file, reference):
    cfg, run, code = _nan_run(tmp_path, token_file, "nan@rank=0,step=7", "stop")
    assert code == 65, _log(cfg)
    (ev,) = runs.read_events(run, "nonfinite")
    assert ev["step"] == 7 and ev["action"] == "stop" and ev["sample_range"] == [60, 70]
    assert not math.isfinite(ev["loss"])
    (stop,) = runs.read_events(run, "nonfinite_stop")
    assert stop["last_finite_step"] == 6
    assert not runs.read_events(run, "restart"), "65 is terminal: no restart"
    assert max(e["step"] for e in runs.read_events(run, "step")) == 6
    assert sorted(_valid_commits(run / "ckpt")) == [3, 6], "older commits survive, nothing after 6"
    assert not [p for p in (run / "ckpt").glob("step-*") if layout.parse_step_dir(p.name) > 6]
    ref = runs.step_losses(reference)
    assert runs.step_losses(run) == {s: ref[s] for s in range(1, 7)}
    assert runs.read_events(run, "supervisor_exit")[-1]["exit_code"] == 65


def test_nan_with_rollback_skips_the_samples_and_finishes(tmp_path, token_file, reference):
    cfg, run, code = _nan_run(tmp_path, token_file, "nan@rank=0,step=7", "rollback")
    assert code == 0, _log(cfg)
    (rb,) = runs.read_events(run, "rollback")
    assert (rb["from_step"], rb["to_step"], rb["skipped_range"], rb["skipped_ranges"]) == (7, 6, [60, 70], [[60, 70]])
    losses = runs.step_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values())
    ref = runs.step_losses(reference)
    assert all(losses[s] == ref[s] for s in range(1, 7))
    assert losses[7] != ref[7], "step 7 trained on other samples after the rollback"
    assert not runs.read_events(run, "restart") and not runs.read_events(run, "nonfinite_stop")
    cat = Catalog(open_storage(str(run / "ckpt")))
    manifests = {c.step: c.manifest for c in cat.scan() if cat.problem(c) is None}
    assert sorted(manifests) == [9, 12]
    assert all(m["skipped_ranges"] == [[60, 70]] for m in manifests.values()), manifests
    assert manifests[9]["parent"] == "step-00000006"


def test_a_second_nan_before_a_save_after_a_rollback_stops(tmp_path, token_file):
    cfg, run, code = _nan_run(tmp_path, token_file, "nan@rank=0,step=7;nan@rank=0,step=8", "rollback")
    assert code == 65, _log(cfg)
    assert [e["step"] for e in runs.read_events(run, "nonfinite")] == [7, 8]
    assert len(runs.read_events(run, "rollback")) == 1
    (stop,) = runs.read_events(run, "nonfinite_stop")
    assert "second non-finite event" in stop["reason"] and stop["last_finite_step"] == 7
    assert not runs.read_events(run, "restart")
    assert sorted(_valid_commits(run / "ckpt")) == [3, 6], "nothing committed after the rollback"


# ---------------------------------------------------------------------------- fencing
def _pids_of(sup) -> list[int]:
    return runs.worker_pids(sup.pid)


def test_two_launches_on_one_root_fence_the_older_and_a_relaunch_resumes_at_once(tmp_path, token_file, reference):
    root = tmp_path / "ckpt"
    cfg_a, run_a = _config(
        tmp_path, token_file, "a", ckpt_dir=str(root), checkpoint={"keep_last": 5}, elastic={"max_restarts": 2}
    )
    cfg_b, run_b = _config(tmp_path, token_file, "b", ckpt_dir=str(root), checkpoint={"keep_last": 5})
    a = runs.start_launch(cfg_a)
    b = None
    # B is slowed from step 7 on (a sleep: the losses stay the same), so that it is killed with
    # steps left and the relaunch has steps to commit under its own epoch.
    slow_b = {"ELASTIC_TRAINER_INJECT_FAULT": "slow@rank=0,step=7,seconds=2.0"}
    try:
        runs.wait_event(run_a, "checkpoint_committed", TIMEOUT, a, where=lambda r: r["step"] == 3)
        # Hold A's workers while B takes the root, so that A has steps left to be fenced on.
        held = _pids_of(a)
        assert len(held) == 2
        runs.kill(held, signal.SIGSTOP)
        try:
            b = runs.start_launch(cfg_b, env=slow_b)
            epoch_b = runs.wait_event(run_b, "checkpoint_epoch", 120, b)["epoch"]
        finally:
            runs.kill(held, signal.SIGCONT)
        code_a = a.wait(timeout=TIMEOUT)
        # B goes on; kill it (no preemption) once it committed past A's last commit.
        runs.wait_event(run_b, "checkpoint_committed", TIMEOUT, b, where=lambda r: r["step"] >= 6)
        workers = _pids_of(b)
        os.killpg(b.pid, signal.SIGKILL)
        runs.kill(workers)
        b.wait(timeout=30)
    finally:
        runs.stop(a)
        if b is not None:
            runs.stop(b)
    assert code_a == 73, _log(cfg_a)
    fenced = runs.read_events(run_a, "fenced")
    assert fenced and epoch_b in fenced[-1]["error"] and "newer launch" in fenced[-1]["error"], fenced
    assert runs.read_events(run_a, "checkpoint_fenced") or fenced[-1]["step"] is None
    assert not runs.read_events(run_a, "restart"), "73 is terminal: no restart"
    assert runs.read_events(run_a, "supervisor_exit")[-1]["exit_code"] == 73
    a_commits = [e for e in runs.read_events(run_a, "checkpoint_committed")]
    t_b = runs.read_events(run_b, "checkpoint_epoch")[0]["time"]
    assert all(e["time"] < t_b for e in a_commits), "A committed after B took the root"
    assert runs.read_events(run_b, "resume")[0]["step"] == max(e["step"] for e in a_commits)

    # Relaunch (a new launch, no flag): it takes the root at once and resumes B's newest commit.
    b_commits = runs.read_events(run_b, "checkpoint_committed")
    cfg_c, run_c = _config(tmp_path, token_file, "c", ckpt_dir=str(root), checkpoint={"keep_last": 5})
    t0 = time.time()
    r = runs.run_launch(cfg_c, timeout=TIMEOUT)
    assert r.returncode == 0, _log(cfg_c)
    (resume,) = runs.read_events(run_c, "resume")
    assert resume["step"] == max(e["step"] for e in b_commits)
    assert resume["time"] - t0 < 90, "the relaunch must not wait for the killed launch"
    assert not runs.read_events(run_c, "checkpoint_fenced")

    # Nothing lost or mixed: every step of the three launches has the uninterrupted loss, each
    # commit is in storage with the epoch of the launch that wrote it, and the lineage is whole.
    ref = runs.step_losses(reference)
    for run in (run_a, run_b, run_c):
        for e in runs.read_events(run, "step"):
            assert e["loss"] == ref[e["step"]], (run.name, e["step"])
    cat = Catalog(open_storage(str(root)))
    cands = {c.name: c for c in cat.scan()}
    epochs = list(cat.fence.records())
    assert len(epochs) == 3 and epochs[1] == epoch_b
    for run, epoch in ((run_a, epochs[0]), (run_b, epochs[1]), (run_c, epochs[2])):
        for e in runs.read_events(run, "checkpoint_committed"):
            c = cands[e["name"]]
            assert cat.problem(c) is None and c.manifest["epoch"] == epoch, (e, c.manifest.get("epoch"))
            assert _bytes_match_manifest(root / c.name, c.manifest), (
                f"{c.name}: files do not match the manifest (mixed writers?)"
            )
    head = cat.head()
    assert head.step == STEPS and head.manifest["epoch"] == epochs[2]
    chain = [c.step for c in lineage(head, cat.scan())]
    assert chain == sorted(chain, reverse=True) and chain[-1] == 3, chain


def test_a_launch_fenced_at_its_final_commit_does_not_claim_success(tmp_path, token_file):
    """The newer launch takes the root while the older one trains its last steps: the commit
    of the final step is refused, and the older launch must exit 73, not 0."""
    cfg, run = _config(tmp_path, token_file, "a")
    # Steps 10-12 sleep 2 s each (the losses stay the same): a window to fence the launch in.
    a = runs.start_launch(cfg, env={"ELASTIC_TRAINER_INJECT_FAULT": "slow@rank=0,step=10,seconds=2.0"})
    try:
        runs.wait_event(run, "checkpoint_committed", TIMEOUT, a, where=lambda r: r["step"] == 9)
        # commit 9's retention (keep_last = 2) deleted step 3 before the fence; nothing after it may
        runs.wait_event(run, "checkpoint_deleted", TIMEOUT, a, where=lambda r: r["step"] == 3)
        held = _pids_of(a)
        runs.kill(held, signal.SIGSTOP)
        try:
            last = max(e["step"] for e in runs.read_events(run, "step"))
            assert last < STEPS, "too late: step 12 already ran (rerun on a less loaded machine)"
            newer = Catalog(open_storage(str(run / "ckpt"))).fence.acquire("newer-launch")
        finally:
            runs.kill(held, signal.SIGCONT)
        code = a.wait(timeout=TIMEOUT)
    finally:
        runs.stop(a)
    assert not [e for e in runs.read_events(run, "checkpoint_committed") if e["step"] == STEPS]
    assert runs.read_events(run, "checkpoint_fenced"), _log(cfg)
    assert code == 73, f"fenced at the final commit, exited {code}\n{_log(cfg)}"
    assert newer in runs.read_events(run, "fenced")[-1]["error"]
    assert sorted(_valid_commits(run / "ckpt")) == [6, 9], "keep_last = 2: nothing deleted by the fenced launch"


# ---------------------------------------------------------------------------- HMAC
class _Boom:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_with_a_key_a_forged_metadata_is_refused_before_unpickling(tmp_path, token_file):
    env = {"ELASTIC_TRAINER_CHECKPOINT_KEY": "k3y-for-tests"}
    cfg, run = _config(tmp_path, token_file, "run", train={"steps": 6})
    r = runs.run_launch(cfg, timeout=TIMEOUT, env=env)
    assert r.returncode == 0, _log(cfg)
    d = run / "ckpt" / "step-00000006"
    signed = json.loads((d / layout.MANIFEST).read_text())
    assert "hmac" in signed

    marker = tmp_path / "PWNED"
    evil = pickle.dumps(_Boom(str(marker)))
    (d / ".metadata").write_bytes(evil)
    forged = dict(signed)
    forged["files"] = dict(signed["files"], **{".metadata": {"size": len(evil), "xxh3": layout.digest(evil)}})
    forged["total_bytes"] = sum(f["size"] for f in forged["files"].values())
    forged = layout.seal(forged, None)
    forged["hmac"] = signed["hmac"]  # looks signed; the signature is of the original
    (d / layout.MANIFEST).write_text(json.dumps(forged, indent=2, sort_keys=True))

    # The tools refuse it, before reading it.
    inspect = subprocess.run(
        [*runs.CLI, "ckpt", "inspect", str(run / "ckpt"), "--step", "6"],
        capture_output=True,
        text=True,
        timeout=120,
        env=runs.env_for_tests(env),
        cwd=runs.REPO,
        check=False,
    )
    assert inspect.returncode != 0 and "signature does not verify" in inspect.stderr, (
        inspect.stdout,
        inspect.stderr[-2000:],
    )
    assert not marker.exists(), "ckpt inspect unpickled the forged .metadata"
    listed = subprocess.run(
        [*runs.CLI, "ckpt", "list", str(run / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
        env=runs.env_for_tests(env),
        cwd=runs.REPO,
        check=False,
    )
    assert listed.returncode == 0 and "signature does not verify" in listed.stdout, listed.stdout

    # The resume falls back to step 3, never unpickling step 6's .metadata.
    r = runs.run_launch(cfg, timeout=TIMEOUT, env=env)
    assert r.returncode == 0, _log(cfg)
    assert not marker.exists(), "the resume unpickled the forged .metadata"
    assert any(
        e["step"] == 6 and "signature does not verify" in e["reason"]
        for e in runs.read_events(run, "checkpoint_skipped")
    )
    assert runs.read_events(run, "resume")[-1]["step"] == 3
    assert _head(run / "ckpt", key=b"k3y-for-tests").name == "step-00000006.1"


# ---------------------------------------------------------------------------- slow storage
@pytest.mark.s3
def test_slow_storage_kills_no_worker_and_training_goes_on(
    tmp_path, token_file, reference, s3_server, s3_bucket, fault_proxy
):
    """The workers' first PUTs (rank 0's start-up record, the save of step 3) are held 7 s each
    (hang timeout 5 s): no worker is killed as hung; the save lands late or fails visibly, later
    saves commit; every step runs with the reference loss."""
    prefix = "jobs/slow"
    cfg, run = _config(
        tmp_path,
        token_file,
        "run",
        ckpt_dir=f"s3://{s3_bucket}/{prefix}",
        checkpoint={
            "s3_endpoint_url": fault_proxy.endpoint_url,
            "storage_timeout_seconds": 40.0,
            "save_timeout_seconds": 30.0,
        },
        elastic={"hang_timeout_seconds": 5.0, "max_restarts": 1},
    )
    creds = {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": s3_server.region,
    }
    # Two objects of the save of step 3 (chosen by path: other writers, such as the event mirror,
    # must not take the delays), and rank 0's start-up record, its resume base: rank 1 waits for
    # rank 0's decision. That one is armed once the supervisor has written the launch's epoch (the
    # same path, before any worker exists: holding it would only delay the start).
    fault_proxy.delay_next(2, 7.0, methods=("PUT",), path_contains="/step-00000003/")
    sup = runs.start_launch(cfg, env=creds)
    try:
        runs.wait_event(run, "checkpoint_epoch", 60, sup)
        fault_proxy.delay_next(1, 7.0, methods=("PUT",), path_contains="/_epochs/")
        code = sup.wait(timeout=TIMEOUT)
    finally:
        runs.stop(sup)
    assert code == 0, _log(cfg)
    assert fault_proxy.pending == 0 and fault_proxy.faulted.get("PUT") == 3
    assert not runs.read_events(run, "restart") and not runs.read_events(run, "failure"), (
        "a worker was killed or failed"
    )
    assert runs.step_losses(run) == runs.step_losses(reference)
    committed = {e["step"]: e for e in runs.read_events(run, "checkpoint_committed")}
    failed = {e["step"]: e for e in runs.read_events(run, "checkpoint_failed")}
    assert 3 in committed or 3 in failed, "the slow save neither landed nor failed visibly"
    outcome = (
        f"committed in {committed[3]['seconds']:.1f}s" if 3 in committed else f"failed: {failed[3]['error'][:300]}"
    )
    print(f"slow save of step 3: {outcome}")
    # Training went on while the save of 3 was slow: steps ran before it resolved.
    resolved = (committed.get(3) or failed.get(3))["time"]
    assert [e for e in runs.read_events(run, "step") if 3 < e["step"] and e["time"] < resolved], (
        "training waited for the slow save"
    )
    assert STEPS in committed
    (fin,) = runs.read_events(run, "finished")
    assert fin["step"] == STEPS and fin["last_committed_step"] == STEPS
