"""The only private Lightning API :mod:`elastic_trainer.lightning` uses, in one place.

Lightning offers no public hook for "resume from this state without a ``ckpt_path``" nor for
"give me the Trainer's own state (loops, callbacks, precision plugin, hyper-parameters) without
the weights". Both live on the Trainer's checkpoint connector:

* :func:`trainer_state`: ``trainer._checkpoint_connector.dump_checkpoint(weights_only=False)``, the
  dict ``trainer.save_checkpoint`` writes (the strategy leaves the weights and optimizer states
  out: ours are saved sharded beside it);
* :func:`restore_trainer_state`: sets ``trainer._checkpoint_connector._loaded_checkpoint``, which the
  Trainer's own restore (``Trainer._run``: ``strategy.setup`` → ``_restore_modules_and_callbacks`` →
  ``restore_training_state`` → ``resume_end``, for a strategy with
  ``restore_checkpoint_after_setup``) then applies exactly as for ``fit(ckpt_path=...)``.

``tests/unit/test_lightning_private.py`` fails loudly when a Lightning release changes either.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def trainer_state(trainer: pl.Trainer) -> dict[str, Any]:
    """What ``trainer.save_checkpoint`` would write, hooks included (``on_save_checkpoint`` of the
    module and callbacks run)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def restore_trainer_state(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Have the Trainer restore ``checkpoint`` (loops, callbacks, precision plugin, LR schedulers,
    the module's ``on_load_checkpoint``) in its own restore step of this ``fit``, which follows
    ``strategy.setup``."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


BATCH_COUNTS = ("ready", "started", "processed", "completed")


def rescale_batch_progress(trainer: pl.Trainer, old: int, new: int) -> None:
    """The fit loop's batch counts, restored from a checkpoint whose optimizer steps took ``old``
    micro-batches each, in steps of ``new``: Lightning decides the optimizer step (``ready %
    accumulate_grad_batches``) and the epoch's end (``ready == num_training_batches``) from
    ``trainer.fit_loop.epoch_loop.batch_progress``, which a resume at another world size must
    count in that world size's micro-batches."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (progress.total, progress.current):
        for name in BATCH_COUNTS:
            setattr(tracker, name, getattr(tracker, name) // old * new)
