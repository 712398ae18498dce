"""Pure pieces of the loop API and of ``run``/script agreement, without a process group."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch

from elastic_trainer import exit_codes
from elastic_trainer.config import Config, TrainConfig, keys_set, load_config, run_name
from elastic_trainer.contract import CONFIG_ENV, CONFIG_SET_ENV
from elastic_trainer.errors import ConfigError
from elastic_trainer.runtime.loop import Accumulator, StepData, to_device
from elastic_trainer.runtime.sampler import GlobalBatchSampler
from elastic_trainer.runtime.session import PreemptionFlag, resolve_config
from elastic_trainer.supervisor import policy
from tests import runs


def test_paths_are_derived_from_the_script_or_config_name_never_the_demo():
    assert (
        run_name("examples/train_fsdp.py") == "train_fsdp"
        and run_name("pkg.mod.train") == "train"
        and run_name(None) is None
    )
    cfg = load_config(None, [], name="train_fsdp")
    assert (cfg.run.dir, cfg.checkpoint.dir) == ("runs/train_fsdp", "runs/train_fsdp/checkpoints")
    cfg = load_config(None, ["run.dir=/data/r1"], name="x")
    assert cfg.checkpoint.dir == "/data/r1/checkpoints", "checkpoints follow the run directory"
    cfg = load_config(None, ["checkpoint.dir=s3://bucket/p"], name="x")
    assert (cfg.run.dir, cfg.checkpoint.dir) == ("runs/x", "s3://bucket/p")


def test_under_a_supervisor_the_script_merges_on_top_but_may_not_move_the_paths(monkeypatch, tmp_path):
    sup = load_config(None, ["run.dir=runs/a", "checkpoint.dir=s3://bucket/a", "train.steps=7"])
    monkeypatch.setenv(CONFIG_ENV, sup.to_json())
    cfg = resolve_config(
        None, ["train.global_batch_size=12", "checkpoint.dir=s3://bucket/a", f"run.dir={os.path.abspath('runs/a')}"]
    )
    assert (cfg.train.steps, cfg.train.global_batch_size, cfg.checkpoint.dir) == (7, 12, "s3://bucket/a")
    with pytest.raises(ConfigError, match="checkpoint.dir.*supervisor"):
        resolve_config(None, ["checkpoint.dir=runs/elsewhere"])
    job = tmp_path / "job.toml"
    job.write_text('[train]\nsteps = 99\n[run]\ndir = "runs/other"\n')
    with pytest.raises(ConfigError, match="run.dir"):
        resolve_config(str(job))
    job.write_text("[train]\nsteps = 99\n")
    assert resolve_config(str(job)).train.steps == 99 and resolve_config(str(job)).checkpoint.dir == "s3://bucket/a", (
        "a file merges, never replaces"
    )
    for given in ({"train": {"steps": 99}}, Config(train=TrainConfig(steps=99))):  # a dict or Config: the same way
        cfg = resolve_config(given, ["train.seed=3"])
        assert (cfg.train.steps, cfg.train.seed, cfg.checkpoint.dir) == (99, 3, "s3://bucket/a"), given
    with pytest.raises(ConfigError, match="run.dir"):
        resolve_config({"run": {"dir": "runs/other"}})


def test_a_key_the_supervisor_s_command_line_set_is_never_replaced_by_the_script_s_own(monkeypatch, tmp_path, caplog):
    """One rule under ``run``: its command line (``--config`` file, ``--set``) > the script's own
    settings > the defaults. ``run --set checkpoint.interval_steps=100 train.py`` saves every 100
    steps although the script's ``et.init`` asks for 5 (which is logged, not used); what the
    command line left alone the script still sets."""
    job = tmp_path / "sup.toml"
    job.write_text("[train]\nseed = 7\n")
    overrides = ["checkpoint.interval_steps=100", "run.dir=runs/a"]
    assert keys_set(str(job), overrides) == ["checkpoint.interval_steps", "run.dir", "train.seed"]
    sup = load_config(str(job), overrides)
    monkeypatch.setenv(CONFIG_ENV, sup.to_json())
    monkeypatch.setenv(CONFIG_SET_ENV, json.dumps(keys_set(str(job), overrides)))
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.runtime.session"):
        cfg = resolve_config(None, ["checkpoint.interval_steps=5", "train.seed=3", "train.steps=40"])
    assert (cfg.checkpoint.interval_steps, cfg.train.seed, cfg.train.steps) == (100, 7, 40)
    assert "checkpoint.interval_steps=5" in caplog.text and "train.seed=3" in caplog.text
    assert "train.steps" not in caplog.text
    with pytest.raises(ConfigError, match="run.dir"):  # the paths still refuse a disagreeing script
        resolve_config(None, ["run.dir=runs/b"])


def test_a_dict_or_config_without_a_supervisor_takes_overrides_and_the_script_s_paths(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.setattr("sys.argv", ["my_train.py"])
    for given in ({"train": {"steps": 9}}, Config(train=TrainConfig(steps=9))):
        cfg = resolve_config(given, ["train.seed=3"])
        assert (cfg.train.steps, cfg.train.seed, cfg.run.dir) == (9, 3, "runs/my_train"), given


def test_a_first_sigint_is_a_preemption_and_a_second_interrupts():
    flag = PreemptionFlag()
    flag._handler(signal.SIGINT, None)
    assert flag.requested and flag.signal_name == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        flag._handler(signal.SIGINT, None)
    term = PreemptionFlag()
    term._handler(signal.SIGTERM, None)
    term._handler(signal.SIGTERM, None)  # a repeated SIGTERM stays a preemption
    assert term.signal_name == "SIGTERM"


def test_a_failed_final_save_is_reported_as_74():
    assert exit_codes.FINAL_SAVE_FAILED == 74 and exit_codes.FINAL_SAVE_FAILED not in exit_codes.TERMINAL
    assert policy.launch_exit_code(failed=True, signalled=False, preempt_marker=None, worker_exit_codes=[74, 74]) == 74
    assert policy.launch_exit_code(failed=True, signalled=False, preempt_marker=None, worker_exit_codes=[74, 1]) == 1


def test_the_sampler_as_a_batch_sampler_yields_micro_batches_ahead_without_moving_the_cursor():
    # shares 3/2/2: rank 2 has 2 samples, 2 micro-batches
    s = GlobalBatchSampler(50, 7, 2, seed=1, rank=2, world_size=3)
    it = iter(s)
    first = [next(it) for _ in range(4)]  # two steps, prefetched
    assert s.cursor == 0 and [s.pop_weight() for _ in range(4)] == [2, 0, 2, 0], "padding weighs 0"
    assert first[:2] == [mb.indices for mb in s.micro_batches()]
    s.advance()
    assert [mb.indices for mb in s.micro_batches()] == first[2:]
    s.skip([7, 14])  # a rollback skipped the second step's samples: a new iteration starts past them
    it = iter(s)
    assert next(it) == s.at(14)[0].indices


def test_step_data_weights_and_the_accumulator():
    ds = torch.utils.data.TensorDataset(torch.arange(20.0).reshape(20, 1))
    loader = torch.utils.data.DataLoader(ds, batch_size=2)  # the loader's batch_size is the micro-batch
    data = StepData(loader, global_batch=6, seed=0, rank=0, world_size=2, device=torch.device("cpu"))
    assert data.state is data.sampler and data.loader is not loader and data.loader.generator is not None
    assert data.per_step == 2
    (a, wa), (b, wb) = data.next_batch(), data.next_batch()
    assert [len(a[0]), len(b[0])] == [2, 1] and [wa, wb] == [2 / 6, 1 / 6]
    w = torch.ones(1, requires_grad=True)
    acc = Accumulator(torch.device("cpu"))
    acc.backward((w * 3).sum(), wa)
    acc.backward((w * 6).sum(), wb)
    assert (
        acc.count == 2
        and float(acc.loss) == pytest.approx(3 * 2 / 6 + 6 / 6)
        and float(w.grad) == pytest.approx(3 * 2 / 6 + 6 * 1 / 6)
    )
    plain = StepData([{"x": torch.ones(2)}], global_batch=6, seed=0, rank=0, world_size=2, device=torch.device("cpu"))
    assert plain.state is None and plain.per_step == 1 and plain.next_batch()[1] == 0.5
    assert to_device({"a": [torch.ones(1)], "b": 3}, torch.device("cpu"))["b"] == 3


def test_a_loader_that_samples_its_own_way_is_refused_not_replaced():
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    cpu = torch.device("cpu")
    for loader in (
        torch.utils.data.DataLoader(ds, batch_size=None),
        torch.utils.data.DataLoader(ds, sampler=torch.utils.data.SubsetRandomSampler(range(4)), batch_size=2),
        torch.utils.data.DataLoader(
            ds, batch_sampler=torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), 2, False)
        ),
    ):
        with pytest.raises(ConfigError, match="Checkpointer\\(data=\\)"):
            StepData(loader, global_batch=4, seed=0, rank=0, world_size=1, device=cpu)
    shuffled = torch.utils.data.DataLoader(ds, batch_size=3, shuffle=True)
    assert StepData(shuffled, global_batch=4, seed=0, rank=0, world_size=1, device=cpu).sampler.micro_batch_size == 3


PREEMPTED_RANK = """
import os, signal, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from elastic_trainer.runtime.loop import StepData

from elastic_trainer.runtime.sampler import GlobalBatchSampler

class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(4096.0).split(2))

got = []
signal.signal(signal.SIGTERM, lambda *_: got.append("SIGTERM"))
dataset = TensorDataset(torch.arange(4096.0))
loader = {
    "rebuilt": lambda: DataLoader(dataset, batch_size=4, num_workers=2),
    "own sampler": lambda: DataLoader(
        dataset, num_workers=2, batch_sampler=GlobalBatchSampler(4096, 4, 2, seed=0, rank=0, world_size=1)
    ),
    "iterable": lambda: DataLoader(Stream(), batch_size=None, num_workers=1),
}[sys.argv[1]]()
data = StepData(loader, global_batch=4, seed=0, rank=0, world_size=1, device=torch.device("cpu"))
data.next_batch(), data.next_batch()  # both workers have started (and left the rank's process group)
os.killpg(os.getpgid(0), signal.SIGTERM)  # what torch's agent does to a rank at a preemption
signal.sigtimedwait([], 0)  # a no-op system call: the handler has run on return
assert got == ["SIGTERM"], got
for _ in range(20):  # well past what the workers had prefetched
    data.next_batch()
print("served")
"""


@pytest.mark.parametrize("loader", ["rebuilt", "own sampler", "iterable"])
def test_a_preemption_signal_to_the_rank_s_group_leaves_its_dataloader_workers_serving(tmp_path, loader):
    """The agent signals a rank's whole process group; the rank still reads the rest of its step
    and commits. The workers of any DataLoader it reads (rebuilt, with the user's own global batch
    sampler, or iterable) are in a group of their own and keep serving (a worker that exited would
    break a batch the rank is still receiving)."""
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(PREEMPTED_RANK)
    out = subprocess.run(
        [sys.executable, str(script), loader],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
        env=runs.env_for_tests(),  # this checkout's elastic_trainer
    )
    assert out.returncode == 0 and out.stdout.strip() == "served", out.stderr[-3000:]


def test_a_loader_without_shuffle_keeps_the_dataset_s_order_at_every_world_size():
    """``DataLoader(shuffle=False)``: the global order is the dataset's own, split across ranks
    the same way at any world size (and its position checkpointed as the shuffled one's is)."""
    ds = torch.utils.data.TensorDataset(torch.arange(12.0))
    cpu = torch.device("cpu")
    for world in (1, 2, 3):
        seen = []
        for rank in range(world):
            data = StepData(
                torch.utils.data.DataLoader(ds, batch_size=2, shuffle=False),
                global_batch=6,
                seed=5,
                rank=rank,
                world_size=world,
                device=cpu,
            )
            assert data.sampler is not None and data.state is data.sampler
            seen += [i for mb in data.sampler.at(6) for i in mb.indices[: mb.weight]]
        assert seen == [6, 7, 8, 9, 10, 11], world
    shuffled = StepData(
        torch.utils.data.DataLoader(ds, batch_size=2, shuffle=True),
        global_batch=6,
        seed=5,
        rank=0,
        world_size=1,
        device=cpu,
    )
    assert [i for mb in shuffled.sampler.at(0) for i in mb.indices] != [0, 1, 2, 3, 4, 5]
