"""A Lightning script (examples/lightning_fsdp2.py: FSDP2 through ``configure_model``, the real
``lightning`` package) gets the guarantees from ``Trainer(strategy=Strategy())``, under
``elastic-trainer run`` with 2 gloo workers on CPU:

SIGKILL of a worker → the resumed losses equal the uninterrupted run's bitwise (dropout on: per-rank
RNG and Lightning's own state come back); 2 → 3 workers → within 1e-5 and the same global sample
order, none replayed or skipped; SIGTERM → exit 75 with the final step committed, and a same-size
corruption of that newest commit → the previous commit, bitwise continuation; a layer added →
exit 2 naming the key, nothing quarantined; a NaN loss → exit 65, nothing saved after the last
finite step. One uninterrupted run per configuration is shared.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from elastic_trainer.checkpoint import layout
from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.storage.fs import open_storage
from tests import runs

SCRIPT = str(runs.REPO / "tests" / "e2e" / "run_scripts" / "lightning_script.py")
STEPS = 10
CADENCE = ("--set", "checkpoint.interval_steps=3")  # global batch: the loader's 4 × 2 workers of the first launch


def run_script(
    tmp, name, *args, nproc=2, env=None, max_restarts=0, timeout=180, flags=()
) -> subprocess.CompletedProcess:
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = runs.run_args(
        run_dir,
        tmp / (name + "-ckpt"),
        *CADENCE,
        *flags,
        SCRIPT,
        str(run_dir),
        "--samples",
        "64",
        *args,
        nproc=nproc,
        max_restarts=max_restarts,
    )
    with open(run_dir / "run.log", "ab") as out:
        return runs.run_cli(argv, runs.env_for_tests(env), timeout, out)


def _ok(r, tmp, name):
    assert r.returncode == 0, (tmp / name / "run.log").read_text()[-4000:]


def global_order(run_dir) -> dict[int, list[int]]:
    """``{step: sample ids}`` of the last run of each step, ranks in order."""
    rows: dict[tuple[int, int], list[int]] = {}
    for path in sorted(run_dir.glob("samples-*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            rows[(r["step"], r["rank"])] = r["ids"]  # a replayed step after a restart overwrites
    out: dict[int, list[int]] = {}
    for (step, _), ids in sorted(rows.items()):
        out.setdefault(step, []).extend(ids)
    return out


def commits(ckpt) -> dict[str, set[str]]:
    return {p.name: {f.name for f in p.iterdir()} for p in sorted(ckpt.iterdir()) if p.name.startswith("step-")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning-ref")
    _ok(run_script(tmp, "ref", "--steps", str(STEPS)), tmp, "ref")
    _ok(run_script(tmp, "ref0", "--steps", str(STEPS), "--dropout", "0"), tmp, "ref0")
    return {
        "dropout": runs.step_losses(tmp / "ref"),
        "plain": runs.step_losses(tmp / "ref0"),
        "order": global_order(tmp / "ref0"),
    }


def test_reference_trains_on_the_global_batch(reference):
    assert sorted(reference["dropout"]) == list(range(1, STEPS + 1))
    order = reference["order"]
    assert sorted(order) == list(range(1, STEPS + 1)) and all(len(ids) == 8 for ids in order.values())
    seen = [i for step in sorted(order) for i in order[step]]
    assert sorted(seen[:64]) == list(range(64)), "an epoch reads every sample once"


def test_sigkill_resumes_bitwise_with_lightning_state_and_rng(tmp_path, reference):
    r = run_script(
        tmp_path,
        "k",
        "--steps",
        str(STEPS),
        max_restarts=1,
        env={"ELASTIC_TRAINER_INJECT_FAULT": "kill@rank=1,step=8,committed=6"},
    )
    _ok(r, tmp_path, "k")
    (resume,) = runs.read_events(tmp_path / "k", "resume")
    assert resume["step"] == 6 and resume["rng"] == "restored"
    assert runs.step_losses(tmp_path / "k") == reference["dropout"], "bitwise equal to the uninterrupted run"
    assert "Restored all states" not in (tmp_path / "k" / "run.log").read_text(), "no ckpt_path was involved"


# Soak: test_the_loader_s_batch_size_stays_the_micro_batch_from_2_to_1_to_3_workers proves it
# in every run (2 to 1 to 3 workers: each step's samples and loss those of the uninterrupted run).
@pytest.mark.soak
def test_two_to_three_workers_continue_the_global_sample_order(tmp_path, reference):
    r = run_script(
        tmp_path,
        "g",
        "--steps",
        str(STEPS),
        "--dropout",
        "0",
        env={"ELASTIC_TRAINER_INJECT_FAULT": "raise@rank=0,step=8"},
    )
    assert r.returncode != 0
    _ok(run_script(tmp_path, "g", "--steps", str(STEPS), "--dropout", "0", nproc=3), tmp_path, "g")
    (reshard,) = runs.read_events(tmp_path / "g", "reshard")
    assert (reshard["from_world_size"], reshard["to_world_size"], reshard["step"]) == (2, 3, 6)
    got, ref = runs.step_losses(tmp_path / "g"), reference["plain"]
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(7, STEPS + 1):
        assert runs.close_rel(got[step], ref[step], 1e-5), (step, got[step], ref[step])
    order = global_order(tmp_path / "g")
    assert order == reference["order"], "the same samples in the same steps: none replayed, none skipped"


def test_sigterm_commits_the_final_step_and_a_corrupted_newest_commit_falls_back(tmp_path, reference):
    run_dir, ckpt = tmp_path / "p", tmp_path / "p-ckpt"
    run_dir.mkdir()
    args = runs.run_args(run_dir, ckpt, *CADENCE, SCRIPT, str(run_dir), "--samples", "64", "--steps", str(STEPS))
    slow = {"ELASTIC_TRAINER_INJECT_FAULT": "slow@rank=0,step=5,seconds=1"}  # the signal lands mid-run
    code = runs.signal_at_step(args, run_dir, 4, env=slow)
    (pre,) = runs.read_events(run_dir, "preempted")
    assert code == 75 and pre["committed"] is True, (run_dir / "run.log").read_text()[-3000:]
    head = Catalog(open_storage(str(ckpt))).head()
    assert head is not None and head.step == pre["step"] < STEPS, "a commit of the final step exists in storage"
    # A same-size corruption of that newest commit's shard: quarantined, the previous commit loaded.
    newest = ckpt / f"step-{head.step:08d}"
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _ok(run_script(tmp_path, "p", "--steps", str(STEPS)), tmp_path, "p")
    (resume,) = runs.read_events(run_dir, "resume")
    assert resume["step"] == 3 and "checksum mismatch" in json.loads((newest / layout.QUARANTINE).read_text())["reason"]
    assert runs.step_losses(run_dir) == reference["dropout"], "bitwise continuation from the previous commit"


def test_a_layer_added_exits_2_naming_the_key_and_quarantines_nothing(tmp_path):
    export = tmp_path / "export"
    _ok(run_script(tmp_path, "c", "--steps", "3", env={"EXPORT_TO": str(export)}), tmp_path, "c")
    ckpt = tmp_path / "c-ckpt"
    before = commits(ckpt)
    assert list(before) == ["step-00000003"], before
    assert (export / ".metadata").exists() and (export / "meta.pt").exists(), "trainer.save_checkpoint still exports"
    r = run_script(tmp_path, "c", "--steps", "6", "--layers", "3")
    log = (tmp_path / "c" / "run.log").read_text()
    assert r.returncode == 2, log[-4000:]
    assert "model.blocks.2.ln1.weight missing from the checkpoint" in log, log[-4000:]
    assert commits(ckpt) == before and not list(ckpt.rglob(layout.QUARANTINE)), "nothing quarantined or written"
    assert max(runs.step_losses(tmp_path / "c")) == 3, "nothing trained"
    # another seed reorders the samples under the saved cursor: refused, naming it
    r = run_script(tmp_path, "c", "--steps", "6", flags=("--set", "train.seed=7"))
    log = (tmp_path / "c" / "run.log").read_text()[len(log) :]
    assert r.returncode == 2, log[-4000:]
    assert "train.seed" in log, log[-4000:]
    assert commits(ckpt) == before and max(runs.step_losses(tmp_path / "c")) == 3


def test_a_nonfinite_loss_stops_with_65_and_commits_nothing_after_the_last_finite_step(tmp_path):
    r = run_script(tmp_path, "n", "--steps", "6", env={"ELASTIC_TRAINER_INJECT_FAULT": "nan@rank=1,step=5"})
    assert r.returncode == 65, (tmp_path / "n" / "run.log").read_text()[-4000:]
    (ev,) = runs.read_events(tmp_path / "n", "nonfinite")
    (stop,) = runs.read_events(tmp_path / "n", "nonfinite_stop")
    assert ev["step"] == 5 and stop["last_finite_step"] == 4 and max(runs.step_losses(tmp_path / "n")) == 4
    assert Catalog(open_storage(str(tmp_path / "n-ckpt"))).head().step == 3, "the non-finite step is never saved"


def _micro_batches(run_dir) -> dict[int, list[list[int]]]:
    """Step → the sample ids of every micro-batch every rank ran for it, in the launch whose step
    event counts (a rank that began a step its launch then lost is left out)."""
    world = {e["step"]: e["world_size"] for e in runs.read_events(run_dir, "step")}
    out: dict[int, list[list[int]]] = {}
    for path in sorted(run_dir.glob("samples-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["world"] == world[rec["step"]]:
                out.setdefault(rec["step"], []).append(rec["ids"])
    return out


def test_the_loader_s_batch_size_stays_the_micro_batch_from_2_to_1_to_3_workers(tmp_path):
    """``DataLoader(batch_size=4)`` and ``accumulate_grad_batches=2``: the first launch's global
    batch (4 × 2 × 2 = 16) is kept, a worker's forward stays at most 4 samples at every world size
    (4 accumulation steps on 1 worker, a short last micro-batch on 3), every step takes the
    samples of the uninterrupted run, and the losses follow it within 1e-5."""
    args = ("--steps", "9", "--dropout", "0", "--batch-size", "4", "--accumulate", "2", "--samples", "96")
    _ok(run_script(tmp_path, "ref", *args), tmp_path, "ref")
    stop_at = {"ELASTIC_TRAINER_INJECT_FAULT": "raise@rank=0,step=4"}
    assert run_script(tmp_path, "e", *args, env=stop_at).returncode != 0  # step 3 committed (interval 3)
    stop_at = {"ELASTIC_TRAINER_INJECT_FAULT": "raise@rank=0,step=7"}
    assert run_script(tmp_path, "e", *args, nproc=1, env=stop_at).returncode != 0
    _ok(run_script(tmp_path, "e", *args, nproc=3), tmp_path, "e")
    run_dir = tmp_path / "e"
    assert [(e["step"], e["to_world_size"]) for e in runs.read_events(run_dir, "reshard")] == [(3, 1), (6, 3)]
    want, got = runs.step_losses(tmp_path / "ref"), runs.step_losses(run_dir)
    for step in range(1, 10):
        assert runs.close_rel(got[step], want[step], 1e-5), (step, got[step], want[step])
    ref_batches, batches = _micro_batches(tmp_path / "ref"), _micro_batches(run_dir)
    for step in range(1, 10):
        assert max(len(ids) for ids in batches[step]) == 4, (step, batches[step])  # a forward never grows
        assert sorted(i for ids in batches[step] for i in ids) == sorted(i for ids in ref_batches[step] for i in ids)
    assert sorted(len(ids) for ids in batches[2]) == [4, 4, 4, 4], "two workers: 2 micro-batches of 4 each"
    assert sorted(len(ids) for ids in batches[5]) == [4, 4, 4, 4], "one worker: 4 micro-batches of 4"
    assert sorted(len(ids) for ids in batches[8]) == [1, 1, 2, 4, 4, 4], "three: 6 + 5 + 5 samples in 4s"
