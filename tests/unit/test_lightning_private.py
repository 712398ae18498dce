"""The private Lightning API elastic_trainer.lightning depends on (elastic_trainer/lightning/private.py),
checked against the installed Lightning: fails loudly when a release changes it.

* ``trainer_state`` (the checkpoint connector's ``dump_checkpoint``) returns the Trainer's own state;
* ``restore_trainer_state`` (the connector's ``_loaded_checkpoint``), set before the Trainer's restore
  step, resumes a ``fit`` without ``ckpt_path``: loops, callbacks, optimizer and global step;
* ``Trainer._run`` restores after ``strategy.setup`` for a strategy that restores after set-up (where
  the strategy sets it), and Lightning's ``Strategy`` still has the ``_configure_launcher`` the
  strategy overrides.

Also: the example differs from its plain-Lightning form in exactly the two lines docs/lightning.md shows.
"""

from __future__ import annotations

import inspect
import re

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from torch.utils.data import DataLoader, TensorDataset

from elastic_trainer.lightning import private
from tests import runs


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Counter(L.Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, *args):
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


class Restore(L.Callback):
    """Hands a saved state to the Trainer before its restore step (as the strategy does in ``setup``)."""

    def __init__(self, state):
        self.state = state

    def setup(self, trainer, pl_module, stage):
        private.restore_trainer_state(trainer, self.state)


def _trainer(max_steps, *callbacks):
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=list(callbacks),
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=4)


def test_trainer_state_is_the_trainers_own_state_and_restoring_it_resumes_without_ckpt_path(data):
    first, counter = Tiny(), Counter()
    t1 = _trainer(3, counter)
    t1.fit(first, data)
    state = private.trainer_state(t1)
    assert state["global_step"] == 3 and "fit_loop" in state["loops"] and state["lr_schedulers"]
    assert any(v == {"batches": 3} for v in state["callbacks"].values()), state["callbacks"]

    second, counter2 = Tiny(), Counter()
    second.load_state_dict(first.state_dict())
    t2 = _trainer(5, counter2, Restore(state))
    t2.fit(second, data)  # no ckpt_path
    assert second.calls == 2 and t2.global_step == 5, "resumed at step 3: two more steps, not five"
    assert counter2.batches == 5, "the callback's state came back"
    assert t2.lr_scheduler_configs[0].scheduler.last_epoch == 5


def test_the_trainer_restores_after_a_strategy_set_up_that_restores_after_setup():
    src = inspect.getsource(L.Trainer._run)
    setup = src.index("self.strategy.setup(self)")
    restore = src.index("_restore_modules_and_callbacks(ckpt_path)", setup)
    training = src.index("restore_training_state()", restore)
    assert setup < restore < training < src.index("resume_end()", training)
    assert src.index("self.strategy.setup_environment()") < src.index("_call_configure_model(self)") < setup
    assert ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1).restore_checkpoint_after_setup
    resume_start = inspect.getsource(_CheckpointConnector.resume_start)
    assert "_loaded_checkpoint =" not in resume_start.split("if not checkpoint_path:")[0], (
        "resume_start(None) must leave a handed-in state alone"
    )
    assert callable(Strategy._configure_launcher)


def test_the_example_differs_from_plain_lightning_in_the_two_lines_the_docs_show():
    example = (runs.REPO / "examples" / "lightning_fsdp2.py").read_text().splitlines()
    ours = [line for line in example if line.endswith("# elastic_trainer")]
    assert [line.strip() for line in ours] == [
        "from elastic_trainer.lightning import Strategy  # elastic_trainer",
        "strategy=Strategy(),  # elastic_trainer",
    ]
    doc = (runs.REPO / "docs" / "lightning.md").read_text()
    diff = re.search(r"```diff\n(.*?)```", doc, re.S).group(1).splitlines()
    minus = [d[1:].strip() for d in diff if d.startswith("-")]
    plus = [d[1:].strip() for d in diff if d.startswith("+")]
    assert plus == [line.strip() for line in ours] and len(minus) == 2, diff


def test_the_fit_loop_counts_its_batches_where_the_rescale_changes_them():
    """``rescale_batch_progress``: the epoch loop's batch progress and the decision it feeds
    (``ready % accumulate_grad_batches``) are where Lightning keeps them."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    trainer = L.Trainer(accumulate_grad_batches=2, logger=False, enable_checkpointing=False)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (progress.total, progress.current):
        for name in private.BATCH_COUNTS:
            setattr(tracker, name, 6)  # three steps of 2 micro-batches
    private.rescale_batch_progress(trainer, 2, 4)
    assert progress.current.ready == progress.total.completed == 12
    assert "batch_progress.current.ready % self.trainer.accumulate_grad_batches" in inspect.getsource(
        _TrainingEpochLoop._accumulated_batches_reached
    )
