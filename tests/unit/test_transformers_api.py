"""The Transformers internals elastic_trainer.transformers relies on (elastic_trainer/transformers/_api.py
and the Trainer methods it overrides): each test fails loudly, naming what changed, when a
Transformers release changes one of them."""

from __future__ import annotations

import dataclasses
import inspect

import accelerate
import transformers
import transformers.trainer as trainer_module
from accelerate.state import AcceleratorState, PartialState
from transformers import Trainer
from transformers.trainer_callback import TrainerState

from elastic_trainer.transformers import _PROGRESS, _api


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def test_the_trainer_makes_its_accelerator_from_the_module_s_name():
    assert trainer_module.Accelerator is accelerate.Accelerator, "transformers.trainer no longer imports Accelerator"
    source = inspect.getsource(Trainer.create_accelerator_and_postprocess)
    assert "self.accelerator = Accelerator(" in source, "create_accelerator_and_postprocess: no Accelerator( call"
    made = []
    with _api.trainer_accelerator(lambda **kw: made.append(kw)):
        trainer_module.Accelerator(x=1)
    assert made == [{"x": 1}] and trainer_module.Accelerator is accelerate.Accelerator


def test_the_overridden_private_methods_keep_their_signatures():
    assert _params(Trainer._prepare_for_training) == ["max_steps", "train_dataloader", "resume_from_checkpoint"]
    assert _params(Trainer._run_epoch) == [
        "model",
        "epoch",
        "train_dataloader",
        "steps_in_epoch",
        "num_update_steps_per_epoch",
        "trial",
        "ignore_keys_for_eval",
        "start_time",
        "resume_from_checkpoint",
        "epochs_trained",
        "steps_trained_in_current_epoch",
    ], "Trainer._run_epoch changed its parameters"
    assert _params(Trainer._save_checkpoint) == ["model", "trial"]
    assert _params(Trainer._get_num_items_in_batch) == ["batch_samples", "device"]
    assert _params(Trainer._load_callback_state) == []
    assert _params(Trainer.get_batch_samples) == ["epoch_iterator", "num_batches", "device"]
    assert _params(Trainer.create_scheduler) == ["num_training_steps", "optimizer"]


def test_the_training_loop_calls_them_where_the_integration_expects():
    loop = inspect.getsource(Trainer._inner_training_loop)
    order = [
        "self.get_train_dataloader()",
        "self.set_initial_training_values(",
        "self._init_training_state(",
        "self._prepare_for_training(",
        "self._tr_loss = ",  # after the resume: the logging window starts at the resumed step
        "self._globalstep_last_logged = self.state.global_step",
        "self._run_epoch(",
    ]
    at = [loop.find(s) for s in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at, strict=True))
    values = inspect.getsource(Trainer.set_initial_training_values)
    assert values.rstrip().endswith("max_steps,\n        )"), (
        "set_initial_training_values no longer returns max_steps last"
    )
    assert "num_train_epochs,\n            num_update_steps_per_epoch," in values
    prepare = inspect.getsource(Trainer._prepare_for_training)
    assert prepare.find("accelerator.prepare(") < prepare.find("self.create_scheduler("), "the scheduler is made first"
    epoch = inspect.getsource(Trainer._run_epoch)
    assert "self.get_batch_samples(epoch_iterator" in epoch and "self.optimizer.step()" in epoch
    assert "self.lr_scheduler.step()" in epoch and "self.accelerator.prepare(self.lr_scheduler" not in prepare
    save = inspect.getsource(Trainer._maybe_log_save_evaluate)
    assert "self._save_checkpoint(model, trial)" in save


def test_trainer_state_has_the_progress_fields_a_checkpoint_restores():
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    assert set(_PROGRESS) <= fields, set(_PROGRESS) - fields


def test_training_arguments_set_up_accelerate_s_state_which_a_reset_forgets(tmp_path):
    transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert PartialState._shared_state, "TrainingArguments no longer sets up Accelerate's process state when made"
    try:
        _api.reset_accelerate_state()
        assert not PartialState._shared_state and not AcceleratorState._shared_state
    finally:
        AcceleratorState._reset_state(True)
