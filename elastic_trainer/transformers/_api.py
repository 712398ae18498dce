"""Every use of Transformers beyond its documented public API, in one place.

tests/unit/test_transformers_api.py fails loudly when a Transformers release changes any of them:

* ``transformers.trainer.Accelerator``: the name ``Trainer.create_accelerator_and_postprocess``
  calls to make its Accelerator; :func:`trainer_accelerator` points it at ours for that call;
* ``Trainer._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)`` →
  ``(model, train_dataloader)``: the model and optimizer prepared, the scheduler created (the
  resume happens after it);
* ``Trainer._run_epoch(**kwargs)`` with ``epoch``, ``train_dataloader``, ``steps_in_epoch`` and
  ``num_update_steps_per_epoch`` (called with keywords): one epoch's loop, whose counts follow
  the loader at this world size;
* ``Trainer._save_checkpoint(model, trial)``: where the Trainer saves when ``control.should_save``;
* ``Trainer._get_num_items_in_batch(batch_samples, device)``: the token count of a step's
  micro-batches (gathered over processes);
* ``Trainer._load_callback_state()``: restores the callbacks from ``state.stateful_callbacks``;
* ``AcceleratorState._reset_state(reset_partial_state=True)`` (Accelerate's): ``TrainingArguments``
  sets up Accelerate's process state when it is made, before elastic_trainer's process groups
  exist (a world of one on a machine without GPUs); the Trainer's Accelerator starts it afresh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import transformers.trainer as _trainer_module
from accelerate.state import AcceleratorState


@contextlib.contextmanager
def trainer_accelerator(make: Callable[..., Any]) -> Iterator[None]:
    """While inside: ``Trainer.create_accelerator_and_postprocess`` builds its Accelerator with ``make``."""
    saved = _trainer_module.Accelerator
    _trainer_module.Accelerator = make
    try:
        yield
    finally:
        _trainer_module.Accelerator = saved


def load_callback_state(trainer: Any) -> None:
    trainer._load_callback_state()


def reset_accelerate_state() -> None:
    """Forget the process state ``TrainingArguments`` set up (every object sharing it sees the new one)."""
    AcceleratorState._reset_state(reset_partial_state=True)
