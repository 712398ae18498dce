"""Silent data corruption end to end: a bit flipped in rank 1's weights after the optimizer step
of step 13 (finite, small: no guard sees it) is found by ``ckpt audit`` replaying the run from its
start (steps 5 and 10 certified, 15 suspect on rank 1), and a
relaunch resumes from step 10, past the suspect 15 and 20, with losses bitwise equal to a
fault-free run's. The fault-free run's own audit certifies every commit. The same audit replays
scripts under ``elastic-trainer run``: the loop API, Lightning and Accelerate.

``train.min_lr = train.lr``: the learning rate after warm-up is then constant, so a 20-step run
trains its steps exactly as a 30-step one does (the cosine schedule spans ``train.steps``).
With ``train.on_nonfinite = "replay"`` the run finds a large flip itself: the step after it is
refused (its gradient overflows), the run rolls back, replays the same batches, names rank 1 and
finishes on the fault-free curve, bitwise."""

from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path

import pytest

from elastic_trainer import contract, exit_codes
from elastic_trainer.checkpoint import layout
from tests import runs

FAULT = "bitflip@rank=1,step=13"
TRAIN = {"steps": 20, "min_lr": 3e-3}
CHECKPOINT = {"interval_steps": 5, "keep_last": 10}


def _config(d: Path, token_file: str) -> Path:
    return runs.write_config(d / "c.toml", token_file, d / "run", train=TRAIN, checkpoint=CHECKPOINT)


def _launch_ok(cfg: Path, *args: str, env: dict | None = None) -> None:
    r = runs.run_launch(cfg, *args, env=env)
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]


def _audit(root: Path, first: int, last: int, scratch: Path, env: dict | None = None, *flags: str):
    """``ckpt audit``; ``flags``: ``--single-replay`` where a second, confirming replay adds nothing to the test."""
    return runs.run_cli(
        [*runs.CLI, "ckpt", "audit", str(root), "--from", str(first), "--to", str(last), "--scratch", str(scratch)]
        + list(flags),
        runs.env_for_tests(env),
        300,
    )


def _commit_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.glob("step-*/*")
        if p.is_file() and p.name != layout.AUDIT
    }


@pytest.fixture(scope="module")
def faulted(tmp_path_factory, token_file):
    """20 steps with the bit flip, then its audit (the fault still set in the audit's environment:
    the replay must not apply it) and the files of every commit before the audit."""
    d = tmp_path_factory.mktemp("faulted")
    cfg = _config(d, token_file)
    _launch_ok(cfg, env={contract.INJECT_FAULT_ENV: FAULT})
    root = d / "run" / "ckpt"
    before = _commit_files(root)
    audit = _audit(root, 0, 20, d, {contract.INJECT_FAULT_ENV: FAULT}, "--single-replay")
    return cfg, root, before, audit


@pytest.fixture(scope="module")
def resumed(faulted):
    """The faulted run relaunched to 30 steps after its audit."""
    cfg, root, _, _ = faulted
    _launch_ok(cfg, "--set", "train.steps=30")
    return cfg.parent / "run"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, token_file):
    """A fault-free 30-step run."""
    d = tmp_path_factory.mktemp("reference")
    cfg = _config(d, token_file)
    _launch_ok(cfg, "--set", "train.steps=30")
    return d


def test_the_audit_certifies_the_commit_before_the_flip_and_finds_the_rank_after_it(faulted):
    _, root, before, audit = faulted
    assert audit.returncode == 1, audit.stdout + audit.stderr
    lines = audit.stdout.splitlines()
    assert lines[:2] == ["step 5 certified", "step 10 certified"], audit.stdout
    assert lines[2].startswith("step 15 suspect: rank 1 (node 0), first tensor model."), audit.stdout
    assert lines[3].startswith("step 20 suspect: "), audit.stdout
    assert len(lines) == 4, audit.stdout
    assert _commit_files(root) == before, "the commits' own files are never rewritten"
    verdicts = {s: json.loads((root / layout.step_dir_name(s) / layout.AUDIT).read_text()) for s in (5, 10, 15, 20)}
    assert [verdicts[s]["verdict"] for s in (5, 10, 15, 20)] == ["certified", "certified", "suspect", "suspect"]
    assert verdicts[15]["rank"] == 1 and verdicts[15]["tensor"] == lines[2].rsplit(" ", 1)[1]
    events = runs.read_events(root.parent, "checkpoint_audited")
    assert [(e["step"], e["verdict"]) for e in events] == [
        (5, "certified"),
        (10, "certified"),
        (15, "suspect"),
        (20, "suspect"),
    ]


def test_a_relaunch_resumes_past_the_suspect_commits_and_matches_a_fault_free_run(faulted, resumed, reference):
    _, root, _, _ = faulted
    (resume,) = runs.read_events(resumed, "resume")
    assert resume["step"] == 10 and resume["suspect"] == [15, 20], resume
    assert [s for s, _ in resume["skipped"]] == [20, 15]
    ours, clean = runs.step_losses(resumed), runs.step_losses(reference / "run")
    assert [ours[s] for s in range(1, 31)] == [clean[s] for s in range(1, 31)], "bitwise, steps 11-30 retrained"
    for s in (15, 20):  # kept as evidence: never deleted, never quarantined
        d = root / layout.step_dir_name(s)
        assert (d / layout.MANIFEST).exists() and (d / layout.AUDIT).exists()
        assert not (d / layout.QUARANTINE).exists()
    assert not runs.read_events(resumed, "checkpoint_quarantined")


def test_a_fault_free_runs_audit_certifies_every_commit(reference):
    audit = _audit(reference / "run" / "ckpt", 5, 30, reference)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.splitlines() == [f"step {s} certified" for s in (10, 15, 20, 25, 30)]


def test_a_large_flip_is_replayed_located_and_the_run_finishes_on_the_fault_free_curve(tmp_path, token_file, reference):
    train = {**TRAIN, "on_nonfinite": "replay", "loss_spike_factor": 3.0}
    cfg = runs.write_config(tmp_path / "c.toml", token_file, tmp_path / "run", train=train, checkpoint=CHECKPOINT)
    _launch_ok(cfg, env={contract.INJECT_FAULT_ENV: "bitflip@rank=1,step=13,bit=30,param=qkv"})
    run = tmp_path / "run"
    (refused,) = runs.read_events(run, "nonfinite") + runs.read_events(run, "loss_spike")
    assert refused["step"] == 14 and refused["action"] == "replay", refused
    (replay,) = runs.read_events(run, "anomaly_replay")
    assert (replay["step"], replay["from_step"]) == (14, 10)
    (sdc,) = runs.read_events(run, "silent_corruption")
    assert (sdc["rank"], sdc["node"], sdc["ranks"]) == (1, 0, [1]), sdc
    assert sdc["tensor"].endswith("qkv.weight") and sdc["replayed_loss"] != sdc["loss"]
    assert not runs.read_events(run, "rollback"), "nothing skipped"
    ours, clean = runs.step_losses(run), runs.step_losses(reference / "run")
    assert [ours[s] for s in range(1, 21)] == [clean[s] for s in range(1, 21)], "bitwise, the replayed steps too"
    # none of its commits is certified: a start that loads certified ones only stops, and starts nothing over
    before = sorted(p.name for p in (run / "ckpt").glob("step-*"))
    r = runs.run_launch(cfg, "--set", "checkpoint.resume_certified_only=true", "--set", "train.steps=30")
    assert r.returncode == 2, cfg.with_suffix(".log").read_text()[-3000:]
    assert "not certified (checkpoint.resume_certified_only)" in cfg.with_suffix(".log").read_text()
    assert sorted(p.name for p in (run / "ckpt").glob("step-*")) == before and max(runs.step_losses(run)) == 20


def test_with_exclude_corrupt_node_the_corrupt_node_leaves_and_the_other_goes_on_from_the_replayed_step(
    tmp_path, token_file, store, reference
):
    """Two nodes of one worker each (ranks by address: ``a`` 0, ``b`` 1); a large flip on rank 1.
    The replay names node 1: its step is committed, ``b``'s supervisor exits 69 and leaves the
    rendezvous, ``a`` re-forms alone without using a restart (``max_restarts`` 0), resumes from
    the replayed step and finishes on the fault-free curve."""
    train = {**TRAIN, "on_nonfinite": "replay", "loss_spike_factor": 3.0}
    elastic = {"exclude_corrupt_node": True, "max_restarts": 0}
    run = tmp_path / "run"
    cfg = runs.write_config(tmp_path / "c.toml", token_file, run, train=train, checkpoint=CHECKPOINT, elastic=elastic)
    fault = {contract.INJECT_FAULT_ENV: "bitflip@rank=1,step=13,bit=30,param=qkv"}

    def node(name: str, addr: str):
        # both nodes in the first round however slowly one starts on a loaded machine (more than
        # 20 s seen); the survivor's round after the exclusion completes without the last call
        flags = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", store, "--local-addr", addr]
        flags += ["--rdzv-conf", "last_call_timeout=120"]
        env = {**fault, contract.NODE_ENV: name}
        return runs.start_launch(cfg, *flags, "--rdzv-id", "exclude", env=env, log=tmp_path / f"{name}.log")

    a, b = node("a", "127.0.0.2"), node("b", "127.0.0.3")
    try:
        assert b.wait(240) == exit_codes.EXCLUDED, (tmp_path / "b.log").read_text()[-3000:]
        assert a.wait(240) == 0, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        runs.stop(a)
        runs.stop(b)
    (sdc,) = runs.read_events(run, "silent_corruption")
    assert (sdc["step"], sdc["rank"], sdc["node"]) == (14, 1, 1), sdc
    (excluded,) = runs.read_events(run, "node_excluded")
    assert (excluded["step"], excluded["node"], excluded["nodes"], excluded["committed"]) == (14, 1, 2, True)
    assert sorted(e["exit_code"] for e in runs.read_events(run, "supervisor_exit")) == [0, 69]
    (first,) = [e for e in runs.read_events(run, "rendezvous") if e["node"] == "b"]
    assert first["nodes"] == 2, first
    (change,) = runs.read_events(run, "membership_change")
    assert (change["node"], change["from_nodes"], change["to_nodes"]) == ("a", 2, 1), change
    resume = runs.read_events(run, "resume")[-1]
    assert (resume["step"], resume["world_size"]) == (14, 1), resume
    ours, clean = runs.step_losses(run), runs.step_losses(reference / "run")
    assert sorted(ours) == list(range(1, 21))
    for s in range(1, 21):  # world 2, then world 1 after the reshard: the data and loss do not depend on it
        assert runs.close_rel(ours[s], clean[s], 1e-5), (s, ours[s], clean[s])


@pytest.mark.soak  # the front ends' audits below replay scripts under `run` too
def test_a_scripts_commits_are_audited_by_replaying_the_script_under_run(tmp_path):
    """A script under ``elastic-trainer run`` (the loop API example): its manifests record its
    command line, and the audit replays it with ``run`` in the same directory."""
    script = str(runs.REPO / "examples" / "fsdp2_transformer.py")
    run_dir, root = tmp_path / "run", tmp_path / "ckpt"
    keep = ("--set", "checkpoint.keep_last=10")
    args = runs.run_args(run_dir, root, *keep, script, "--steps", "20", max_restarts=0)
    env = runs.env_for_tests({contract.INJECT_FAULT_ENV: FAULT})
    with open(tmp_path / "run.log", "ab") as out:
        r = runs.run_cli(args, env, 240, out)
    assert r.returncode == 0, (tmp_path / "run.log").read_text()[-4000:]
    manifest = json.loads((root / layout.step_dir_name(20) / layout.MANIFEST).read_text())
    command = {"entry": "run", "argv": [script, "--steps", "20"], "cwd": os.getcwd()}
    assert manifest["command"] == {
        **command,
        "set": ["checkpoint.dir", "checkpoint.keep_last", "metrics.port", "run.dir"],
    }
    audit = _audit(root, 5, 20, tmp_path, None, "--single-replay")
    assert audit.returncode == 1, audit.stdout + audit.stderr
    lines = audit.stdout.splitlines()
    assert lines[0] == "step 10 certified" and lines[1].startswith("step 15 suspect: rank 1 (node 0)"), audit.stdout
    assert lines[2].startswith("step 20 suspect: ") and len(lines) == 3, audit.stdout


FRONT_ENDS = {
    # script, its arguments, `run`'s flags: commits every 3 steps, of a model sharded with FSDP2
    # (every rank saves its own shard: a replicated model is saved from rank 0 only)
    "lightning": (
        runs.REPO / "examples" / "lightning_fsdp2.py",
        ["--samples", "64", "--steps", "{steps}"],
        ["--set", "checkpoint.interval_steps=3"],
    ),
    "accelerate": (runs.REPO / "tests" / "e2e" / "run_scripts" / "accelerate_fsdp2.py", ["{project}", "{steps}"], []),
    "transformers": (
        runs.REPO / "examples" / "transformers_clm.py",
        ["--steps", "{steps}", "--save-steps", "3", "--batch-size", "4", "--train-files", "{corpus}"]
        + ["--output-dir", "{project}"],
        [],
    ),
}
BOUNDED = ("lightning", "accelerate")  # the Transformers Trainer is built on the Accelerate front end: soak
FLIP_8 = "bitflip@rank=1,step=8"


def _front_end_run(tmp: Path, front_end: str, steps: int, fault: str | None = None, *flags: str) -> Path:
    """The front end's script under ``run`` to ``steps`` in ``tmp`` (its run.dir; commits in ``tmp/ckpt``)."""
    script, script_args, own = FRONT_ENDS[front_end]
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        shutil.copy(inspect.getsourcefile(inspect) or "", corpus)  # text that no one edits while the test runs
    args = [a.format(project=tmp / "project", steps=steps, corpus=corpus) for a in script_args]
    keep = ("--set", "checkpoint.keep_last=10")
    argv = runs.run_args(tmp / "run", tmp / "ckpt", *own, *keep, *flags, str(script), *args, max_restarts=0)
    env = runs.env_for_tests({contract.INJECT_FAULT_ENV: fault} if fault else None)
    with open(tmp / "run.log", "ab") as out:
        r = runs.run_cli(argv, env, 240, out)
    assert r.returncode == 0, (tmp / "run.log").read_text()[-4000:]
    return tmp / "run"


def _audited_and_located(tmp_path: Path, front_end: str) -> None:
    """The same under the framework front ends: the flip after step 8 leaves 6 certified and 9
    suspect on rank 1; the replay ends the script's process at step 12."""
    _front_end_run(tmp_path, front_end, 12, FLIP_8)
    audit = _audit(tmp_path / "ckpt", 3, 12, tmp_path, None, "--single-replay")
    assert audit.returncode == 1, audit.stdout + audit.stderr
    lines = audit.stdout.splitlines()
    assert len(lines) == 3, audit.stdout + audit.stderr
    assert lines[0] == "step 6 certified" and lines[1].startswith("step 9 suspect: rank 1 (node 0)"), audit.stdout
    assert lines[2].startswith("step 12 suspect: "), audit.stdout


@pytest.mark.parametrize("front_end", BOUNDED)
def test_a_front_end_scripts_commits_are_audited_and_the_flip_located(tmp_path, front_end):
    _audited_and_located(tmp_path, front_end)


@pytest.mark.soak  # the Transformers Trainer is built on the Accelerate front end
def test_the_transformers_trainers_commits_are_audited_and_the_flip_located(tmp_path):
    _audited_and_located(tmp_path, "transformers")


@pytest.mark.soak  # the whole story per framework (the resume past suspect commits is the catalog's: tested above)
@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
def test_a_front_end_run_resumes_past_its_suspect_commits_as_a_fault_free_one_does(tmp_path, front_end):
    """12 steps with the flip, audited from the start (3 and 6 certified, 9 and 12 suspect), then
    trained on to 18: it resumes from 6, past 9 and 12, and trains steps 7-18 bitwise as a
    fault-free run resumed from its commit of step 6 to 18 does; that run's audit certifies every
    commit."""
    faulted, clean = tmp_path / "faulted", tmp_path / "clean"
    for d in (faulted, clean):
        d.mkdir()
    _front_end_run(faulted, front_end, 12, FLIP_8)
    audit = _audit(faulted / "ckpt", 0, 12, faulted, None, "--single-replay")
    lines = audit.stdout.splitlines()
    assert audit.returncode == 1 and lines[:2] == ["step 3 certified", "step 6 certified"], audit.stdout + audit.stderr
    assert lines[2].startswith("step 9 suspect: rank 1 (node 0)") and lines[3].startswith("step 12 suspect: ")
    run = _front_end_run(faulted, front_end, 18)
    (resume,) = runs.read_events(run, "resume")
    assert resume["step"] == 6 and resume["suspect"] == [9, 12], resume
    _front_end_run(clean, front_end, 12)
    audit = _audit(clean / "ckpt", 0, 12, clean, None, "--single-replay")
    assert audit.returncode == 0 and audit.stdout.splitlines() == [f"step {s} certified" for s in (3, 6, 9, 12)]
    _front_end_run(clean, front_end, 18, None, "--set", "checkpoint.resume=6")
    ours, theirs = runs.step_losses(run), runs.step_losses(clean / "run")
    assert [ours[s] for s in range(1, 19)] == [theirs[s] for s in range(1, 19)], "bitwise"
