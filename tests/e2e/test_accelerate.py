"""A Hugging Face Accelerate script (examples/accelerate_clm.py: prepare, accumulate, backward,
clip_grad_norm_, register_for_checkpointing, save_state/load_state, skip_first_batches) on
elastic_trainer by its one changed import, with the real ``accelerate`` package on CPU (gloo, DDP).

Under ``elastic-trainer run``: SIGKILL of a worker → bitwise resume; SIGTERM → 75 with the final
step committed, then 3 workers continue within 1e-5; ``total_limit`` kept through a kill in the
middle of a save; the newest commit corrupted at the same size → fallback, bitwise. Under
``accelerate launch``: the same losses as under ``run``. Plain ``python script.py`` works.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.storage.fs import open_storage
from tests import runs
from tests.fixtures.procs import free_port

SCRIPT = str(runs.REPO / "examples" / "accelerate_clm.py")
STEPS = ["--steps", "12", "--save-every", "3", "--total-limit", "2"]


def run_script(tmp, name: str, *script_args: str, nproc: int = 2, env=None, max_restarts: int = 0):
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = tmp / (name + "-ckpt")
    args = runs.run_args(run_dir, ckpt, SCRIPT, *script_args, nproc=nproc, max_restarts=max_restarts)
    with open(run_dir / "run.log", "ab") as out:
        r = runs.run_cli(args, runs.env_for_tests(env), 240, out)
    return r, run_dir, ckpt


def _log(run_dir) -> str:
    return (run_dir / "run.log").read_text()[-4000:]


def _valid_commits(root) -> list[int]:
    cat = Catalog(open_storage(str(root)))
    return sorted(c.step for c in cat.scan() if cat.problem(c) is None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("acc-ref")
    r, run_dir, ckpt = run_script(tmp, "ref", *STEPS)
    assert r.returncode == 0, _log(run_dir)
    losses = runs.step_losses(run_dir)
    assert sorted(losses) == list(range(1, 13))
    assert _valid_commits(ckpt) == [9, 12], "total_limit = 2 keeps the two newest verified commits"
    return losses


def test_sigkill_of_a_worker_resumes_bitwise(tmp_path, reference):
    r, run_dir, _ = run_script(
        tmp_path, "k", *STEPS, max_restarts=1, env={"ELASTIC_TRAINER_INJECT_FAULT": "kill@rank=1,step=8,committed=6"}
    )
    assert r.returncode == 0, _log(run_dir)
    (resume,) = runs.read_events(run_dir, "resume")
    assert resume["step"] == 6 and resume["rng"] == "restored"
    assert runs.step_losses(run_dir) == reference


def test_sigterm_commits_the_final_step_then_three_workers_continue_within_1e_5(tmp_path, reference):
    run_dir, ckpt = tmp_path / "p", tmp_path / "p-ckpt"
    run_dir.mkdir()
    args = runs.run_args(run_dir, ckpt, SCRIPT, *STEPS)
    slow = {"ELASTIC_TRAINER_INJECT_FAULT": "slow@rank=0,step=1,seconds=0.15"}  # time to signal mid-run
    code = runs.signal_at_step(args, run_dir, 3, env=slow)
    (pre,) = runs.read_events(run_dir, "preempted")
    assert code == 75 and pre["committed"] is True, _log(run_dir)
    done = pre["step"]
    assert done < 12 and Catalog(open_storage(str(ckpt))).head().step == done
    r, _, _ = run_script(tmp_path, "p", *STEPS, nproc=3)
    assert r.returncode == 0, _log(run_dir)
    (reshard,) = runs.read_events(run_dir, "reshard")
    assert reshard["from_world_size"] == 2 and reshard["to_world_size"] == 3
    got = runs.step_losses(run_dir)
    assert set(range(done + 1, 13)) <= set(got)  # the preempted step's own event is not written
    for step in range(done + 1, 13):  # the same samples and learning rate at every step: the global batch is kept
        assert runs.close_rel(got[step], reference[step], 1e-5), (step, got[step], reference[step])


def test_kill_mid_save_keeps_total_limit_and_a_corrupted_newest_commit_falls_back_bitwise(tmp_path, reference):
    r, run_dir, ckpt = run_script(
        tmp_path, "c", *STEPS, env={"ELASTIC_TRAINER_INJECT_FAULT": "kill_in_save@rank=1,step=9"}
    )
    assert r.returncode != 0
    commits = _valid_commits(ckpt)
    assert commits == [3, 6] or commits == [6, 9], commits  # killed mid-save of 9: still total_limit verified
    newest = ckpt / f"step-{commits[-1]:08d}"
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    shard.write_bytes(bytes(data))
    (run_dir / "events.jsonl").unlink()
    r, _, _ = run_script(tmp_path, "c", *STEPS)
    assert r.returncode == 0, _log(run_dir)
    assert commits[-1] in [e["step"] for e in runs.read_events(run_dir, "checkpoint_skipped")]
    (resume,) = runs.read_events(run_dir, "resume")
    assert resume["step"] == commits[-2]
    assert runs.step_losses(run_dir) == {s: reference[s] for s in range(commits[-2] + 1, 13)}


def test_accelerate_launch_gives_the_same_losses(tmp_path, reference):
    out = tmp_path / "al"
    args = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "2",
        "--multi_gpu",  # torchrun under the hood; on a machine without GPUs the processes train on CPU
        "--main_process_port",
        str(free_port()),
        SCRIPT,
        *STEPS,
        "--output-dir",
        str(out),
    ]
    r = runs.run_cli(args, runs.env_for_tests(), 240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert runs.step_losses(out) == reference
    assert _valid_commits(out / "checkpoints") == [9, 12]


# The script under plain python, with torch's object collectives (what DCP's save and load run
# on gloo) counted: a world of one must run none. gloo frees a collective's pickled tensors on its
# own thread a moment after the call returns; when that is a run's last collective (the resume of
# a run already at its end, the final save), the interpreter's exit can abort the process (-6)
# after a good run.
_COUNTED = """
import atexit, runpy, sys, torch.distributed as dist
calls = []
for name in ("gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list", "barrier"):
    def counted(*a, _name=name, _call=getattr(dist, name), **k):
        calls.append(_name)
        return _call(*a, **k)
    setattr(dist, name, counted)
atexit.register(lambda: print("object collectives:", calls))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_plain_python_is_a_world_of_one_and_resumes(tmp_path):
    out = tmp_path / "py"
    args = [sys.executable, "-c", _COUNTED, SCRIPT, "--steps", "4", "--save-every", "2", "--output-dir", str(out)]
    r = runs.run_cli(args, runs.env_for_tests(), 240)
    assert r.returncode == 0, r.stderr[-4000:]
    printed = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert [p["step"] for p in printed] == [1, 2, 3, 4]
    assert _valid_commits(out / "checkpoints") == [2, 4]
    assert "object collectives: []" in r.stdout, r.stdout[-2000:]
    r = runs.run_cli(args, runs.env_for_tests(), 240)
    assert r.returncode == 0, r.stderr[-4000:]
    (resume,) = runs.read_events(out, "resume")
    assert resume["step"] == 4 and not [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert "object collectives: []" in r.stdout, r.stdout[-2000:]


def test_a_nan_loss_stops_with_65_before_the_optimizer_step_and_nothing_after_is_committed(tmp_path):
    out = tmp_path / "nan"
    args = [
        sys.executable,
        str(runs.REPO / "tests" / "e2e" / "run_scripts" / "accelerate_fsdp2.py"),
        str(out),
        "9",
        "5",
    ]
    r = runs.run_cli(args, runs.env_for_tests(), 240)
    assert r.returncode == 65, r.stderr[-4000:]
    (ev,) = runs.read_events(out, "nonfinite")
    assert ev["step"] == 5 and ev["action"] == "stop"
    (stop,) = runs.read_events(out, "nonfinite_stop")
    assert stop["last_finite_step"] == 4
    assert _valid_commits(out / "checkpoints") == [3]


@pytest.mark.soak  # three more launches; every run covers the same machinery with the DDP model above
def test_a_model_sharded_with_fully_shard_before_prepare_checkpoints_and_reshards_2_to_3(tmp_path):
    """FSDP2 through Accelerate on CPU: the user's ``fully_shard`` model is not wrapped in DDP;
    its DTensor shards are committed by 2 workers and resumed by 3 (within 1e-5 of 2 throughout)."""
    script = str(runs.REPO / "tests" / "e2e" / "run_scripts" / "accelerate_fsdp2.py")

    def torchrun(out, nproc: int, steps: int) -> None:
        args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        args += ["--master-port", str(free_port()), script, str(out), str(steps)]
        r = runs.run_cli(args, runs.env_for_tests(), 240)
        assert r.returncode == 0, r.stderr[-4000:]

    ref, out = tmp_path / "ref", tmp_path / "out"
    torchrun(ref, 2, 9)
    torchrun(out, 2, 6)
    torchrun(out, 3, 9)
    (reshard,) = runs.read_events(out, "reshard")
    assert reshard["step"] == 6 and reshard["to_world_size"] == 3
    want, got = runs.step_losses(ref), runs.step_losses(out)
    assert sorted(got) == sorted(want) == list(range(1, 10))
    for step in range(1, 10):
        assert runs.close_rel(got[step], want[step], 1e-5), (step, got[step], want[step])


def test_a_changed_seed_exits_2_naming_it_and_trains_nothing(tmp_path):
    """The training loader's order follows ``train.seed``: a resume under another seed would
    reorder the samples under the saved cursor, so it is refused before any step."""
    script = str(runs.REPO / "tests" / "e2e" / "run_scripts" / "accelerate_fsdp2.py")
    run_dir, ckpt = tmp_path / "s", tmp_path / "s-ckpt"

    def launch(*flags):
        args = runs.run_args(run_dir, ckpt, *flags, script, str(tmp_path / "project"), "3", nproc=1, max_restarts=0)
        return runs.run_cli(args, runs.env_for_tests(), 240)

    r = launch()
    assert r.returncode == 0, r.stderr[-4000:]
    assert _valid_commits(ckpt) == [3]
    r = launch("--set", "train.seed=7", "--set", "checkpoint.interval_steps=1")
    assert r.returncode == 2, r.stderr[-4000:]
    assert "train.seed" in r.stdout + r.stderr
    assert _valid_commits(ckpt) == [3] and len(runs.read_events(run_dir, "step")) == 3


# Soak: `accelerate launch` runs on every run (test_accelerate_launch_gives_the_same_losses), and so do
# an S3 checkpoint root (tests/e2e/test_s3_checkpoint.py) and the config file under any launcher
# (tests/unit/test_config_launchers.py); this puts them together.
@pytest.mark.soak
def test_accelerate_launch_commits_the_final_step_to_the_config_file_s_s3_root_and_run_resumes_it(tmp_path, s3_server):
    """The one configuration under any launcher: ``accelerate launch`` with
    ``ELASTIC_TRAINER_CONFIG`` naming an S3 ``checkpoint.dir`` commits there — a ``save_state``
    step and the final step, which no ``save_state`` saved — and the same script switched to
    ``elastic-trainer run`` resumes those commits."""
    from elastic_trainer import contract

    bucket = s3_server.make_bucket()
    root = f"s3://{bucket}/acc"
    cfg = tmp_path / "acc.toml"
    cfg.write_text(f'[checkpoint]\ndir = "{root}"\ns3_endpoint_url = "{s3_server.endpoint_url}"\nkeep_last = 5\n')
    env = {
        contract.CONFIG_FILE_ENV: str(cfg),
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": s3_server.region,
    }
    out = tmp_path / "out"
    launched = [
        *("-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu"),
        *("--main_process_port", str(free_port()), SCRIPT),
        *("--steps", "5", "--save-every", "3", "--output-dir", str(out)),
    ]
    r = subprocess.run(
        [sys.executable, *launched],
        capture_output=True,
        text=True,
        env=runs.env_for_tests(env),
        cwd=runs.REPO,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert _committed(s3_server, bucket) == [3, 5], "the final step is committed"
    run_dir = tmp_path / "run"
    under_run = [
        *runs.CLI,
        *("run", "--set", f"run.dir={run_dir}", "--set", "metrics.port=0", "--nproc-per-node", "2"),
        *("--max-restarts", "0", "--monitor-interval", "0.2", SCRIPT, "--steps", "7", "--save-every", "3"),
    ]
    r = runs.run_cli(under_run, runs.env_for_tests(env), 240)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
    (resume,) = runs.read_events(run_dir, "resume")
    assert resume["step"] == 5
    assert _committed(s3_server, bucket) == [3, 5, 6, 7], "keep_last of the file, not the script's total_limit"


def _committed(s3, bucket: str) -> list[int]:
    """Steps whose manifest (written last, by the commit) is in the bucket, read from the server."""
    return sorted(int(p.rsplit("/", 2)[-2].split("-")[1]) for p in s3.fs().glob(f"{bucket}/acc/step-*/manifest.json"))


def _micro_batches(run_dir) -> dict[int, list[list[int]]]:
    """Step → the sample ids of every micro-batch every rank ran for it."""
    out: dict[int, list[list[int]]] = {}
    for path in sorted(run_dir.glob("batches-rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(rec["step"], []).append(rec["ids"])
    return out


def test_the_loader_s_batch_size_stays_the_micro_batch_from_2_to_1_to_3_processes(tmp_path):
    """``DataLoader(batch_size=4)`` and 2 accumulation steps: the global batch of the first launch
    (4 × 2 × 2 = 16) is kept, each process's forward stays at most 4 samples at every world size
    (more accumulation steps on 1, a short last micro-batch on 3), every step takes the samples
    of the uninterrupted run, and the losses follow it within 1e-5."""
    script = str(runs.REPO / "tests" / "e2e" / "run_scripts" / "accelerate_batches.py")

    def launch(name: str, nproc: int, steps: int):
        run_dir, ckpt = tmp_path / name, tmp_path / f"{name}-ckpt"
        run_dir.mkdir(exist_ok=True)
        args = runs.run_args(
            run_dir, ckpt, "--set", "checkpoint.interval_steps=2", script, str(run_dir), str(steps), nproc=nproc
        )
        r = runs.run_cli(args, runs.env_for_tests(), 240)
        assert r.returncode == 0, r.stderr[-4000:]
        return run_dir

    reference = launch("ref", 2, 9)
    launch("e", 2, 3)
    launch("e", 1, 6)
    elastic = launch("e", 3, 9)
    assert [e["to_world_size"] for e in runs.read_events(elastic, "reshard")] == [1, 3]
    want, got = runs.step_losses(reference), runs.step_losses(elastic)
    for step in range(1, 10):
        assert runs.close_rel(got[step], want[step], 1e-5), (step, got[step], want[step])
    ref_batches, batches = _micro_batches(reference), _micro_batches(elastic)
    for step in range(1, 10):
        sizes = [len(ids) for ids in batches[step]]
        assert max(sizes) == 4, (step, sizes)  # a process's forward never grows
        assert sorted(i for ids in batches[step] for i in ids) == sorted(i for ids in ref_batches[step] for i in ids)
    assert sorted(len(ids) for ids in batches[5]) == [4, 4, 4, 4], "one process: 4 micro-batches of 4"
    assert sorted(len(ids) for ids in batches[8]) == [1, 1, 2, 4, 4, 4], "three: 6 + 5 + 5 samples in 4s"


def test_an_unshuffled_training_loader_keeps_its_order_and_position_across_a_resume(tmp_path):
    """``DataLoader(shuffle=False)`` handed to ``prepare`` with the optimizer is the training one:
    the dataset's own order, step after step, continued where the commit was taken; the evaluation
    loader beside it stays Accelerate's."""
    script = str(runs.REPO / "tests" / "e2e" / "run_scripts" / "accelerate_batches.py")
    out = tmp_path / "seq"
    out.mkdir()
    sets = f"run.dir={out};checkpoint.dir={tmp_path / 'seq-ckpt'};checkpoint.interval_steps=1"
    env = runs.env_for_tests({"SHUFFLE": "0", "ELASTIC_TRAINER_SET": sets})
    for steps in (2, 4):
        r = subprocess.run(
            [sys.executable, script, str(out), str(steps)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=240,
        )
        assert r.returncode == 0, r.stderr[-4000:]
    seen = [
        i for ids in (json.loads(x)["ids"] for x in (out / "batches-rank0.jsonl").read_text().splitlines()) for i in ids
    ]
    assert seen == list(range(32)), "4 steps of 8 samples in the dataset's order, none replayed"
    (resume,) = runs.read_events(out, "resume")
    assert resume["step"] == 2
