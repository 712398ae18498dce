"""A Hugging Face Transformers ``Trainer`` script (examples/transformers_clm.py: a GPT-2 from a
config with dropout, ``save_steps``, ``save_total_limit``, a cosine schedule with warm-up,
gradient accumulation 2) on elastic_trainer by its one changed import, with the real
``transformers`` package on CPU (gloo, 2 workers under ``elastic-trainer run``).

The launches are shared by the module (the suite's time budget): one uninterrupted run with
dropout and one whose worker is SIGKILLed (bitwise: losses and final parameters); one
uninterrupted run without dropout, and one SIGTERMed (exit 75, the final step committed) then
continued by 3 workers (within 1e-5, every step the same samples); a changed model refused with
exit 2 naming the key. Every launch runs the example through
tests/e2e/run_scripts/transformers_logged.py, which only logs each micro-batch's samples.
"""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
from collections import Counter

import pytest
import torch

from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.checkpoint.tools import load_model_weights
from elastic_trainer.storage.fs import open_storage
from tests import runs
from tests.fixtures.procs import free_port

SCRIPT = str(runs.REPO / "tests" / "e2e" / "run_scripts" / "transformers_logged.py")
STEPS = 9
ARGS = ["--steps", str(STEPS), "--save-steps", "3", "--save-total-limit", "2", "--batch-size", "4"]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    """The module's directory, with a corpus that no one edits while the module runs."""
    d = tmp_path_factory.mktemp("transformers")
    shutil.copy(inspect.getsourcefile(inspect), d / "corpus.txt")  # ~3,600 blocks of 32 bytes
    return d


def launch(tmp, name: str, *extra: str, nproc: int = 2, env=None, max_restarts: int = 0):
    run_dir, ckpt = tmp / name, tmp / f"{name}-ckpt"
    run_dir.mkdir(exist_ok=True)
    args = runs.run_args(run_dir, ckpt, *_script(tmp, name, *extra), nproc=nproc, max_restarts=max_restarts)
    with open(run_dir / "run.log", "ab") as out:
        r = runs.run_cli(args, runs.env_for_tests(env), 240, out)
    return r.returncode, run_dir, ckpt


def _script(tmp, name: str, *extra: str) -> list[str]:
    run_dir = tmp / name
    out = ["--train-files", str(tmp / "corpus.txt"), "--output-dir", str(tmp / f"{name}-out")]
    return [SCRIPT, str(run_dir), *ARGS, *out, *extra]


def _log(run_dir) -> str:
    return (run_dir / "run.log").read_text()[-5000:]


def _valid_commits(root) -> list[int]:
    cat = Catalog(open_storage(str(root)))
    return sorted(c.step for c in cat.scan() if cat.problem(c) is None)


def _batches(run_dir) -> dict[int, list[list[str]]]:
    """Step → the samples of every micro-batch every rank ran for it."""
    out: dict[int, list[list[str]]] = {}
    for path in sorted(run_dir.glob("batches-rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(rec["step"], []).append(rec["rows"])
    return out


@pytest.fixture(scope="module")
def with_dropout(tmp):
    code, run_dir, ckpt = launch(tmp, "ref")
    assert code == 0, _log(run_dir)
    losses = runs.step_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert _valid_commits(ckpt) == [6, 9], "save_steps 3, save_total_limit 2: the two newest verified commits"
    return losses, ckpt


@pytest.fixture(scope="module")
def without_dropout(tmp):
    code, run_dir, _ = launch(tmp, "ref0", "--dropout", "0")
    assert code == 0, _log(run_dir)
    return runs.step_losses(run_dir), _batches(run_dir)


def test_sigkill_of_a_worker_resumes_bitwise_losses_and_final_parameters(tmp, with_dropout):
    reference, ref_ckpt = with_dropout
    kill = {"ELASTIC_TRAINER_INJECT_FAULT": "kill@rank=1,step=8,committed=6"}
    code, run_dir, ckpt = launch(tmp, "kill", env=kill, max_restarts=1)
    assert code == 0, _log(run_dir)
    (resume,) = runs.read_events(run_dir, "resume")
    assert resume["step"] == 6 and resume["rng"] == "restored"
    assert runs.step_losses(run_dir) == reference
    # warm: forked from the zygote that imported transformers (and datasets, pyarrow's jemalloc thread)
    assert [e["warm"] for e in runs.read_events(run_dir, "workers_started")] == [True, True]
    _, want = load_model_weights(str(ref_ckpt), STEPS)
    _, got = load_model_weights(str(ckpt), STEPS)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), "the final parameters differ"


def test_a_corrupted_newest_commit_falls_back_and_continues_bitwise(tmp, with_dropout):
    """The newest commit damaged at the same size (a flipped range in one shard): it is skipped,
    the previous one loads, and the steps after it are the uninterrupted run's bit for bit."""
    reference, ref_ckpt = with_dropout
    run_dir, ckpt = tmp / "corrupt", tmp / "corrupt-ckpt"
    shutil.copytree(ref_ckpt, ckpt)
    shard = ckpt / f"step-{STEPS:08d}" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    shard.write_bytes(bytes(data))
    code, run_dir, _ = launch(tmp, "corrupt")
    assert code == 0, _log(run_dir)
    assert STEPS in [e["step"] for e in runs.read_events(run_dir, "checkpoint_skipped")]
    (resume,) = runs.read_events(run_dir, "resume")
    assert resume["step"] == 6
    got = runs.step_losses(run_dir)
    assert {s: got[s] for s in range(7, STEPS + 1)} == {s: reference[s] for s in range(7, STEPS + 1)}


def test_sigterm_commits_the_final_step_then_three_workers_continue_within_1e_5(tmp, without_dropout):
    reference, ref_batches = without_dropout
    run_dir, ckpt = tmp / "term", tmp / "term-ckpt"
    run_dir.mkdir()
    args = runs.run_args(run_dir, ckpt, *_script(tmp, "term", "--dropout", "0"), nproc=2, max_restarts=0)
    slow = {"ELASTIC_TRAINER_INJECT_FAULT": "slow@rank=0,step=1,seconds=0.2"}  # time to signal mid-run
    code = runs.signal_at_step(args, run_dir, 3, env=slow)
    (pre,) = runs.read_events(run_dir, "preempted")
    assert code == 75 and pre["committed"] is True, _log(run_dir)
    done = pre["step"]
    assert done < STEPS and Catalog(open_storage(str(ckpt))).head().step == done
    code, _, _ = launch(tmp, "term", "--dropout", "0", nproc=3)
    assert code == 0, _log(run_dir)
    (reshard,) = runs.read_events(run_dir, "reshard")
    assert reshard["from_world_size"] == 2 and reshard["to_world_size"] == 3
    got = runs.step_losses(run_dir)
    assert set(range(done + 1, STEPS + 1)) <= set(got)  # the preempted step's own event is not written
    for step in sorted(got):  # the same samples and learning rate at every step: the global batch is kept
        assert runs.close_rel(got[step], reference[step], 1e-5), (step, got[step], reference[step])
    batches = _batches(run_dir)
    assert sorted(batches) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # no sample replayed or skipped: each step's are the uninterrupted run's
        assert max(len(rows) for rows in batches[step]) == 4, "a forward never grows beyond the micro-batch"
        samples = Counter(r for rows in batches[step] for r in rows)
        assert samples == Counter(r for rows in ref_batches[step] for r in rows), step
        assert sum(samples.values()) == 16, step
    assert sorted(len(rows) for rows in batches[STEPS]) == [1, 1, 2, 4, 4, 4], "3 workers: 6 + 5 + 5 samples in 4s"


def test_save_model_writes_the_final_commit_s_model_and_any_commit_exports_for_from_pretrained(tmp, with_dropout):
    """``trainer.save_model()`` after ``train()`` (the example's last line) writes what the final
    commit holds; ``ckpt export --hf OUTPUT_DIR`` makes any commit a ``from_pretrained`` folder
    with that commit's logits."""
    from transformers import AutoModelForCausalLM

    _, ref_ckpt = with_dropout
    saved = AutoModelForCausalLM.from_pretrained(tmp / "ref-out")
    _, final = load_model_weights(str(ref_ckpt), STEPS)
    state = saved.state_dict()
    assert set(state) == set(final) and all(torch.equal(state[k], final[k]) for k in final)
    out = tmp / "step-6-model"
    export = [sys.executable, "-m", "elastic_trainer.cli", "ckpt", "export", str(ref_ckpt), "--step", "6"]
    r = subprocess.run(
        [*export, "--out", str(out), "--hf", str(tmp / "ref-out")],
        capture_output=True,
        text=True,
        env=runs.env_for_tests(),
        cwd=runs.REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["step"] == 6
    _, weights = load_model_weights(str(ref_ckpt), 6)
    model = AutoModelForCausalLM.from_config(saved.config)
    model.load_state_dict(weights)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.arange(32)[None]
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model.eval()(tokens).logits)


def test_a_changed_model_exits_2_naming_the_key_and_trains_nothing(tmp, with_dropout):
    _, ref_ckpt = with_dropout
    run_dir, ckpt = tmp / "changed", tmp / "changed-ckpt"
    shutil.copytree(ref_ckpt, ckpt)
    code, run_dir, _ = launch(tmp, "changed", "--n-layer", "3", "--steps", str(STEPS + 3), nproc=1)
    assert code == 2, _log(run_dir)
    assert "transformer.h.2" in _log(run_dir)
    assert runs.read_events(run_dir, "step") == []
    assert _valid_commits(ckpt) == [6, 9]


def test_the_example_runs_under_python_torchrun_and_accelerate_launch_each_resuming_the_last(tmp):
    """The example itself under each plain launcher on one ``output_dir``: ``python`` (a world of
    one) commits step 3, ``torchrun`` (2 processes) resumes it and commits 6, ``accelerate
    launch`` (2) resumes 6 and ends at 9; each launch's first step is the one after its resume."""
    out = tmp / "launchers-out"
    example = str(runs.REPO / "examples" / "transformers_clm.py")
    common = ["--train-files", str(tmp / "corpus.txt"), "--output-dir", str(out), "--save-steps", "3"]
    launchers = [
        [sys.executable],
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())],
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu"]
        + ["--main_process_port", str(free_port())],
    ]
    run_dir = out / "elastic_trainer"
    for i, launcher in enumerate(launchers):
        steps = 3 * (i + 1)
        r = runs.run_cli([*launcher, example, *common, "--steps", str(steps)], runs.env_for_tests(), 240)
        assert r.returncode == 0, r.stderr[-4000:]
        assert _valid_commits(run_dir / "checkpoints")[-1] == steps
    resumes = runs.read_events(run_dir, "resume")
    assert [(e["step"], e["from_world_size"], e["world_size"]) for e in resumes] == [(3, 1, 2), (6, 2, 2)]
    assert sorted(runs.step_losses(run_dir)) == list(range(1, 10))
