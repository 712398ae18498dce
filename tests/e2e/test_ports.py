"""Loops written elsewhere, ported to the loop API (examples/fsdp2_transformer.py: the PyTorch
examples' FSDP2 transformer; examples/hf_causal_lm.py: a transformers causal-LM loop), each under
``elastic-trainer run``: a SIGKILLed worker → bitwise resume; SIGTERM → exit 75 with the final step
committed; that commit resumed by 3 workers → within 1e-5 of the uninterrupted run."""

from __future__ import annotations

import pytest

from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.storage.fs import open_storage
from tests import runs

PORTS = {
    "fsdp2_transformer": runs.REPO / "examples" / "fsdp2_transformer.py",
    "hf_causal_lm": runs.REPO / "examples" / "hf_causal_lm.py",
}
STEPS = "10"


def _args(tmp, name: str, port: str, nproc: int = 2, max_restarts: int = 0) -> tuple[list[str], object]:
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    args = runs.run_args(run_dir, tmp / "ckpt" / name, str(PORTS[port]), nproc=nproc, max_restarts=max_restarts)
    return args, run_dir


def _run(tmp, name, port, *script_args, env=None, **kw):
    args, run_dir = _args(tmp, name, port, **kw)
    with open(run_dir / "run.log", "ab") as out:
        r = runs.run_cli([*args, *script_args], runs.env_for_tests(env), 300, out)
    return r, run_dir


# Soak: both ports run the loop-API machinery that tests/e2e/test_own_script.py and test_snippets.py
# (1, 2 and 3 workers) run in every suite; a Hugging Face causal LM under `run` (SIGKILL → bitwise,
# SIGTERM → 75, 2 → 3 workers within 1e-5) is tests/e2e/test_transformers.py's, in every suite too.
@pytest.mark.soak
@pytest.mark.parametrize("port", sorted(PORTS))
def test_port_resumes_bitwise_after_sigkill_commits_on_sigterm_and_reshards(tmp_path, port):
    r, ref_dir = _run(tmp_path, "ref", port, "--steps", STEPS)
    assert r.returncode == 0, (ref_dir / "run.log").read_text()[-3000:]
    ref = runs.step_losses(ref_dir)
    assert sorted(ref) == list(range(1, int(STEPS) + 1))
    # SIGKILL of a worker at step 7, once step 5's async save has committed (on any machine):
    # restarted, resumed from step 5, bitwise the same losses.
    r, kill_dir = _run(
        tmp_path,
        "kill",
        port,
        "--steps",
        STEPS,
        env={"ELASTIC_TRAINER_INJECT_FAULT": "kill@rank=1,step=7,committed=5"},
        max_restarts=1,
    )
    assert r.returncode == 0, (kill_dir / "run.log").read_text()[-3000:]
    assert runs.read_events(kill_dir, "resume")[0]["step"] == 5
    assert runs.step_losses(kill_dir) == ref, "bitwise equal to the uninterrupted run"
    # SIGTERM mid-run: the final step committed, exit 75; then 3 workers resume it within 1e-5.
    args, term_dir = _args(tmp_path, "term", port)
    # The same --steps as the reference: a schedule over the run's length (the HF port's linear
    # decay) must be the same schedule; paced (0.3 s a step) so the stop lands well before the end.
    code = runs.signal_at_step(
        [*args, "--steps", STEPS], term_dir, 3, env={"ELASTIC_TRAINER_INJECT_FAULT": "slow@rank=0,step=1,seconds=0.3"}
    )
    (pre,) = runs.read_events(term_dir, "preempted")
    assert code == 75 and pre["committed"] is True, (term_dir / "run.log").read_text()[-3000:]
    head = Catalog(open_storage(str(tmp_path / "ckpt" / "term"))).head()
    assert head is not None and head.step == pre["step"] < int(STEPS)
    r, _ = _run(tmp_path, "term", port, "--steps", STEPS, nproc=3)
    assert r.returncode == 0, (term_dir / "run.log").read_text()[-3000:]
    (reshard,) = runs.read_events(term_dir, "reshard")
    assert (reshard["from_world_size"], reshard["to_world_size"], reshard["step"]) == (2, 3, pre["step"])
    got = runs.step_losses(term_dir)
    for step in range(pre["step"] + 1, int(STEPS) + 1):
        assert abs(got[step] - ref[step]) <= 1e-5 * abs(ref[step]), (step, got[step], ref[step])
