"""Hugging Face Transformers ``Trainer`` on elastic_trainer: change one import.

    from elastic_trainer.transformers import Trainer      # was: from transformers import Trainer

A subclass of ``transformers.Trainer`` whose Accelerator is elastic_trainer's
(:class:`elastic_trainer.accelerate.Accelerator`: the shared :class:`~elastic_trainer.runtime.run.Run`,
one step context per optimizer step, one stop protocol), with the Trainer's own hooks mapped
onto it:

* the training loader is world-size invariant (the global batch of the first launch,
  ``per_device_train_batch_size × processes × gradient_accumulation_steps``, kept at every later
  world size by changing ``gradient_accumulation_steps``), its position in every checkpoint;
* ``train()`` resumes from the newest valid commit (or the one ``resume_from_checkpoint`` names)
  after the model, optimizer and scheduler exist: model, optimizer, scheduler, ``TrainerState``
  (``global_step``, ``epoch``, ``log_history``, best metric) and the callbacks' state, per-rank RNG
  and the data position; the Trainer's own ``checkpoint-N`` folders are never written;
* ``save_steps`` is the checkpoint cadence, ``save_total_limit`` the retention of verified
  commits, ``output_dir/elastic_trainer`` the run directory (checkpoints in its ``checkpoints``),
  ``data_seed`` (else ``seed``) the sample order's seed, checked at every resume; anything set
  under ``elastic-trainer run --set`` or ``ELASTIC_TRAINER_SET`` wins;
* SIGTERM/SIGUSR1/Ctrl-C: the agreed final save, exit 75 (76 if it did not commit) — which
  ``enable_jit_checkpoint`` asks for; ``train()`` ends with the final step committed (exit 0,
  else 74).

Settings it cannot serve stop the process with exit 2 naming the field before training. See
docs/transformers.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections import deque
from typing import Any, NoReturn, cast

import accelerate
import torch
import transformers
from torch.utils.data import IterableDataset
from transformers.trainer_callback import ExportableState, TrainerCallback

from .. import exit_codes
from ..accelerate import Accelerator
from ..errors import ConfigError
from ..runtime.session import Session, write_resolved_config
from . import _api

__all__ = ["Trainer"]

# TrainerState fields a checkpoint restores: the run's progress. The rest (max_steps, the
# logging/eval/save step counts, the process flags) belong to this launch's arguments.
_PROGRESS = (
    "epoch",
    "global_step",
    "num_input_tokens_seen",
    "total_flos",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
    "stateful_callbacks",
)
_COMMIT_DIR = re.compile(r"^step-(\d+)$")
RUN_SUBDIR = "elastic_trainer"  # output_dir/elastic_trainer: run.dir; its checkpoints/: checkpoint.dir


def _value(choice: Any) -> str:
    """An enum field of ``TrainingArguments`` (``SaveStrategy.STEPS``) as its string ("steps")."""
    return str(getattr(choice, "value", choice))


def _refuse(field: str, why: str) -> NoReturn:
    """A TrainingArguments setting this integration cannot serve: exit 2 naming it, before training."""
    raise ConfigError(f"TrainingArguments.{field}", why)


def check_args(args: transformers.TrainingArguments) -> None:
    if args.load_best_model_at_end:
        _refuse(
            "load_best_model_at_end",
            "True needs the Trainer's checkpoint-N folders, which are not written (commits go to checkpoint.dir); "
            "the best step is in trainer.state.best_global_step: export it with `elastic-trainer ckpt export "
            "--step N`, or keep every commit with checkpoint.keep_every",
        )
    if args.save_only_model:
        _refuse(
            "save_only_model",
            "True: a commit always holds the whole training state (a resume needs it); the model alone comes "
            "from trainer.save_model() or `elastic-trainer ckpt export`",
        )
    if args.auto_find_batch_size:
        _refuse("auto_find_batch_size", "True would change the micro-batch the run's global batch is made of")
    if args.deepspeed:
        _refuse("deepspeed", "DeepSpeed is not served (its engine checkpoints itself)")
    if args.train_sampling_strategy not in ("random", "sequential"):
        _refuse(
            "train_sampling_strategy",
            f"{args.train_sampling_strategy!r}: only 'random' and 'sequential' have a world-size-invariant order",
        )
    if args.push_to_hub and _value(args.hub_strategy) in ("checkpoint", "all_checkpoints"):
        _refuse("hub_strategy", f"{args.hub_strategy!r} pushes checkpoint-N folders, which are not written")


def commit_step(resume: str | bool | None) -> int | None:
    """The step ``train(resume_from_checkpoint=...)`` names: None for True, False or None (the
    newest valid commit), N for a commit folder ``.../step-0000000N``; anything else (a Trainer
    ``checkpoint-N`` folder) is refused."""
    if resume is None or isinstance(resume, bool):
        return None
    m = _COMMIT_DIR.match(os.path.basename(os.path.normpath(str(resume))))
    if m is None:
        _refuse(
            "resume_from_checkpoint",
            f"{resume!r} is not a commit of this run (a folder step-NNNNNNNN of checkpoint.dir); True or None "
            "resume from the newest valid commit",
        )
    return int(m.group(1))


def launch_settings(args: transformers.TrainingArguments) -> dict[str, Any]:
    """What ``TrainingArguments`` set of the run's configuration when the Accelerator is made:
    the sample order's seed (``data_seed``, else ``seed``: part of the run's identity) and the
    retention (``save_total_limit``; None keeps ``checkpoint.keep_last``)."""
    seed = args.data_seed if args.data_seed is not None else args.seed
    values: dict[str, Any] = {"train.seed": int(seed)}
    if args.save_total_limit:
        values["checkpoint.keep_last"] = int(args.save_total_limit)
    return values


def train_settings(save_strategy: str, save_steps: float, resume_step: int | None) -> dict[str, Any]:
    """What ``train()`` sets before the resume: the cadence (``save_strategy`` "steps": every
    ``save_steps``; "epoch" and "best": none, the Trainer's own moments save, see
    ``Trainer._save_checkpoint``; "no": none, the final step only) and the commit to resume."""
    values: dict[str, Any] = {"checkpoint.interval_steps": int(save_steps) if save_strategy == "steps" else 0}
    if resume_step is not None:
        values["checkpoint.resume"] = str(resume_step)
    return values


def apply_settings(session: Session, values: dict[str, Any]) -> None:
    """Set ``section.key`` values as the script's settings: below what the command line
    (``run --set``) or the environment (``ELASTIC_TRAINER_SET``) set. Before the run is built."""
    cfg = session.cfg
    changed = False
    for key, value in values.items():
        if key in session.explicit:
            continue
        section, name = key.split(".")
        part = getattr(cfg, section)
        if getattr(part, name) == value:
            continue
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(part, **{name: value})})
        changed = True
    if changed:
        session.cfg = cfg
        if session.rank == 0:
            write_resolved_config(cfg)


class _TrainerState:
    """The Trainer's state and its callbacks' (``ExportableState``) as one checkpointed object:
    the ``trainer_state.json`` of a Trainer checkpoint, the same on every rank."""

    def __init__(self, trainer: Trainer):
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self._trainer
        exported: dict[str, Any] = {}
        for cb in [*t.callback_handler.callbacks, t.control]:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                if name in exported:
                    before = exported[name]
                    exported[name] = [*(before if isinstance(before, list) else [before]), cb.state()]
                else:
                    exported[name] = cb.state()
        cast(Any, t.state).stateful_callbacks = exported  # typed as a list; a dict by name, as the Trainer keeps it
        return {"trainer_state": json.dumps(dataclasses.asdict(t.state), sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = json.loads(state_dict["trainer_state"])
        t = self._trainer
        for name in _PROGRESS:
            setattr(t.state, name, saved.get(name))
        if t.state.log_history is None:
            t.state.log_history = []
        if t.state.stateful_callbacks is None:
            cast(Any, t.state).stateful_callbacks = {}
        _api.load_callback_state(t)


class _TrainerAccelerator(Accelerator):
    """elastic_trainer's Accelerator as the Trainer drives it: the Trainer accumulates itself
    (Accelerate's own accumulation stays 1), prefetches a step's micro-batches before the first
    backward, and scales each micro-batch's loss itself (by the step's token count, or by the
    accumulation steps); this accelerator weighs them so that the gradient is the global batch's
    at every world size, and a padding micro-batch counts zero."""

    def __init__(self, *args: Any, trainer_args: transformers.TrainingArguments, **kwargs: Any):
        # the run's files apart from what save_model() writes to output_dir (its config.json is the model's)
        kwargs.setdefault("project_dir", os.path.join(trainer_args.output_dir or "trainer_output", RUN_SUBDIR))
        _api.reset_accelerate_state()  # made by TrainingArguments before our process groups existed
        super().__init__(*args, **kwargs)
        check_args(trainer_args)
        apply_settings(self.session, launch_settings(trainer_args))
        self.trainer_accumulation = int(trainer_args.gradient_accumulation_steps)
        self.loss_counts_tokens = False  # this step's loss is normalised by its global token count
        self._weights: deque[int | None] = deque()  # real samples of each fetched micro-batch not yet backward'ed
        self._expect_train = False

    @property
    def sampler(self) -> Any:
        """The training loader's world-size-invariant batch sampler (None before it is prepared)."""
        return self._sampler

    @property
    def batch_weights(self) -> list[int | None]:
        """Real samples of the micro-batches fetched and not yet through ``backward`` (0: padding)."""
        return list(self._weights)

    def training_loader(self, make: Any) -> Any:
        """``make()`` prepares the Trainer's training DataLoader: it becomes the world-size-invariant one."""
        self._expect_train = True
        try:
            return make()
        finally:
            self._expect_train = False

    def prepare_data_loader(self, data_loader: Any, device_placement=None, slice_fn_for_dispatch=None):
        if self._expect_train and self._train_loader is None:
            self._train_candidate = data_loader  # shuffled or not, this one is the training loader
        return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)

    def _prepare_train_loader(self, loader: Any, device_placement: bool | None) -> Any:
        # the first launch's global batch counts the Trainer's accumulation steps
        self.gradient_accumulation_steps = self.trainer_accumulation
        try:
            return super()._prepare_train_loader(loader, device_placement)
        finally:
            self.gradient_accumulation_steps = 1

    def _set_layout(self, layout: dict[str, int]) -> None:
        super()._set_layout(layout)
        if self._sampler is not None:
            self.trainer_accumulation = self._sampler.per_step
        self.gradient_accumulation_steps = 1

    def _next_batch(self) -> None:
        self._weights.append(self._sampler.pop_weight() if self._sampler is not None else None)
        self._end_step()
        self._begin_step()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The Trainer's loss of one micro-batch: divided by the step's global token count (times
        the processes), or a mean divided by the accumulation steps. Counted with its share of
        the global batch: 1 (token-normalised; 0 for padding), or its real samples × processes ×
        accumulation steps / global batch."""
        self._end_step()
        self._begin_step()
        weight = self._weights.popleft() if self._weights else None
        processes = self.num_processes
        factor = 1.0
        if weight is not None and self._sampler is not None:
            if self.loss_counts_tokens:
                factor = 1.0 if weight else 0.0
            else:
                factor = weight * processes * self._sampler.per_step / self._sampler.global_batch_size
        self._loss += loss.detach().to(torch.float64).cpu() * factor / processes
        accelerate.Accelerator.backward(self, loss if factor == 1.0 else loss * factor, **kwargs)

    def finish_run(self) -> int:
        """The run's end after ``train()``: the last step's boundary and the final commit (0, 73, 74)."""
        return self._finish()


class _Progress(TrainerCallback):
    """``state.epoch`` from the data position (the same value the uninterrupted run computes,
    also after a resume mid-epoch)."""

    def __init__(self, accelerator: _TrainerAccelerator):
        self._acc = accelerator

    def on_step_end(self, args, state, control, **kwargs):
        sampler = self._acc.sampler
        if sampler is not None:
            span = sampler.steps_per_epoch * sampler.global_batch_size
            epoch, done = divmod(sampler.cursor, span)
            state.epoch = epoch + (done // sampler.global_batch_size * sampler.per_step) / len(sampler)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` with every guarantee of elastic_trainer; see the module docstring."""

    accelerator: _TrainerAccelerator

    def __init__(self, *args: Any, **kwargs: Any):
        targs = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if targs is not None and targs.enable_jit_checkpoint:
            # our preemption handling serves it: every rank agrees, the final step is committed (75)
            targs.enable_jit_checkpoint = False
        super().__init__(*args, **kwargs)
        self.add_callback(_Progress(self.accelerator))
        self._limits: tuple[int, int] | None = None  # max_steps, num_train_epochs of this train()
        self._resume_step: int | None = None  # the commit resume_from_checkpoint names
        self._trained = False

    def create_accelerator_and_postprocess(self) -> None:
        with _api.trainer_accelerator(functools.partial(_TrainerAccelerator, trainer_args=self.args)):
            super().create_accelerator_and_postprocess()

    def get_train_dataloader(self):
        if isinstance(self.train_dataset, IterableDataset):
            _refuse("train_dataset", "an IterableDataset has no world-size-invariant order; use a map-style dataset")
        return self.accelerator.training_loader(super().get_train_dataloader)

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        self._limits = (values[6], values[0])
        return values

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kw):
        """``resume_from_checkpoint`` True, None or False: the newest valid commit (a restarted
        worker must continue; there is no fresh start over a run's commits: use another
        ``output_dir`` or ``checkpoint.dir``); a path to a commit (``.../step-00000040``): that step.
        Ends with the final step committed; a code other than 0 ends the process with it."""
        if trial is not None:
            _refuse("hyperparameter_search", "a trial per run is not served")
        if self._trained:
            raise RuntimeError("elastic_trainer.transformers: train() runs once per process (one run, one end)")
        self._trained = True
        self._resume_step = commit_step(resume_from_checkpoint)
        out = super().train(resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=ignore_keys_for_eval, **kw)
        code = self.accelerator.finish_run()
        if code != exit_codes.OK:
            raise SystemExit(code)
        return out

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """On the torch optimizer inside Accelerate's wrapper (whose ``step`` is the step boundary)."""
        if optimizer is None and self.optimizer is not None:
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        return super().create_scheduler(num_training_steps, optimizer)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        acc = self.accelerator
        # save_steps as the state resolved it (a ratio of max_steps made a step count)
        apply_settings(
            acc.session, train_settings(_value(self.args.save_strategy), self.state.save_steps, self._resume_step)
        )
        acc.register_for_checkpointing(self.lr_scheduler)
        acc.register_for_checkpointing(_TrainerState(self))
        acc.load_state()
        self.args.gradient_accumulation_steps = acc.trainer_accumulation
        return model, train_dataloader

    def _run_epoch(
        self,
        model,
        epoch,
        train_dataloader,
        steps_in_epoch,
        num_update_steps_per_epoch,
        trial,
        ignore_keys_for_eval,
        start_time,
        resume_from_checkpoint,
        epochs_trained,
        steps_trained_in_current_epoch,
    ):
        """One epoch of the Trainer's loop, counted at this world size from where the data
        position is (a resume continues mid-epoch; the loader yields the rest of the epoch)."""
        kwargs = {
            "model": model,
            "epoch": epoch,
            "train_dataloader": train_dataloader,
            "trial": trial,
            "ignore_keys_for_eval": ignore_keys_for_eval,
            "start_time": start_time,
            "resume_from_checkpoint": None,  # the resume is done: nothing to skip, no RNG to load
            "epochs_trained": epochs_trained,
            "steps_trained_in_current_epoch": 0,
        }
        loader = train_dataloader
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return
        sampler = self.accelerator.sampler
        last = self._limits is not None and epoch == self._limits[1] - 1
        while True:
            if sampler is not None:
                kwargs["epoch"] = sampler.cursor // (sampler.steps_per_epoch * sampler.global_batch_size)
            kwargs["steps_in_epoch"] = len(loader)
            kwargs["num_update_steps_per_epoch"] = max(len(loader) // self.args.gradient_accumulation_steps, 1)
            super()._run_epoch(**kwargs)
            # the last epoch the Trainer counted (at the first launch's world size) may not be the run's last
            if not last or self.control.should_training_stop or self.state.global_step >= self.state.max_steps:
                return

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches; a padding one's labels are ignored (-100) where the loss is
        normalised by the step's token count, so it counts zero there too."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        counted = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        weights = self.accelerator.batch_weights[-len(batches) :] if batches else []
        if counted:
            for batch, weight in zip(batches, weights, strict=True):
                if weight == 0 and isinstance(batch, dict) and "labels" in batch:
                    batch["labels"] = torch.full_like(batch["labels"], -100)
        num_items = self._get_num_items_in_batch(batches, device)
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items is not None) or self.compute_loss_func is not None
        self.accelerator.loss_counts_tokens = bool(scaled)
        return batches, num_items

    def _save_checkpoint(self, model, trial) -> None:
        """``save_strategy`` "epoch" or "best": an async commit of this step. "steps" saves on the
        cadence (``checkpoint.interval_steps``, from ``save_steps``); no checkpoint-N folder."""
        if self.args.save_strategy != "steps":
            self.store_flos()
            self.accelerator.save_state()
