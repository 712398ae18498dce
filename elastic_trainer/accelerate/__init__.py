"""Hugging Face Accelerate on elastic_trainer: change one import.

    from elastic_trainer.accelerate import Accelerator      # was: from accelerate import Accelerator

Every call keeps its Accelerate meaning; these run on elastic_trainer's machinery (the
:class:`~elastic_trainer.runtime.run.Run` of every front end, one step context per optimizer
step, ended by the run's one stop protocol):

* the constructor calls :func:`elastic_trainer.init` first (process groups that survive
  restarts under ``elastic-trainer run``, events, metrics, preemption, the hang watchdog), then
  Accelerate's (configuration as :func:`elastic_trainer.init` resolves it under any launcher);
  ``ProjectConfiguration(project_dir=, total_limit=)`` sets ``run.dir`` and ``checkpoint.dir``
  (``project_dir/checkpoints``) where no configuration and no supervisor sets them, and
  ``checkpoint.keep_last``;
* ``prepare`` of the training ``DataLoader`` (the one with ``shuffle=True``) gives it a
  world-size-invariant batch sampler: the global batch of the first launch (``batch_size ×
  num_processes × gradient_accumulation_steps``) and its sample order at any world size, the
  position in the checkpoint; a model already sharded with ``fully_shard`` is left as it is;
* ``save_state()`` → an async, verified commit to ``checkpoint.dir`` (any fsspec/S3 root);
  ``load_state()`` → the newest valid commit (resharded, falling back past a damaged one), or a
  fresh start when there is none; the data loader continues where the commit was taken;
* each optimizer step is one step of the own-loop API: the non-finite guard, the hang watchdog,
  step events and metrics, agreed preemption (the final step committed: exit 75, else 76), and
  saves on the cadence (``checkpoint.interval_steps``, ``interval_seconds``, ``auto``) besides
  ``save_state()``; ``end_training()`` (or the script's end) commits the final step: exit 0,
  else 74 (73 when a newer launch owns the root).

See docs/accelerate.md.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sized
from typing import Any, cast

import accelerate
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from .. import faults
from ..errors import ConfigError
from ..runtime import init
from ..runtime.epochs import EpochBatchSampler
from ..runtime.loop import WorkerInit, _rebuilt, shuffled
from ..runtime.run import Run, open_run
from . import _api

__all__ = ["Accelerator"]


def _map_style(loader: Any) -> bool:
    """A ``DataLoader`` over a map-style dataset with a ``batch_size``: one the loop can sample."""
    return (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and loader.batch_size is not None
        and isinstance(loader.sampler, (RandomSampler, SequentialSampler))
    )


class _BatchLayout(Stateful):
    """The global batch and the scheduler steps per optimizer step, fixed by the first launch
    (same on every rank): a resume at another world size keeps both, so the data order, the
    gradient and the learning rate are the ones of the uninterrupted run."""

    def __init__(self, get: Callable[[], dict[str, int]], set_: Callable[[dict[str, int]], None]):
        self._get, self._set = get, set_

    def state_dict(self) -> dict[str, Any]:
        return {"layout": json.dumps(self._get())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._set(json.loads(state_dict["layout"]))


class Accelerator(accelerate.Accelerator):
    def __init__(self, *args: Any, **kwargs: Any):
        pc = kwargs.get("project_config")
        project_dir = kwargs.get("project_dir") or (pc.project_dir if pc is not None else None)
        # project_dir: the front end's default paths, below any config (a supervisor's are its own);
        # init refuses a start whose root has no commit while the other default's root has some.
        paths = []
        if project_dir:
            paths = [f"run.dir={project_dir}", f"checkpoint.dir={os.path.join(project_dir, 'checkpoints')}"]
        overrides = [f"checkpoint.keep_last={pc.total_limit}"] if pc is not None and pc.total_limit else []
        self.session = init(overrides=overrides, defaults=paths)
        if self.session.cfg.train.on_nonfinite != "stop":
            raise ConfigError(
                "train.on_nonfinite",
                f"only 'stop' is served under Accelerate (got {self.session.cfg.train.on_nonfinite!r}): a rollback "
                "or a replay restarts the loop's iteration, which the script owns",
            )
        if self.session.device.type == "cpu":  # Accelerate's MULTI_CPU (DDP over gloo) on the session's group
            kwargs["cpu"] = True
        super().__init__(*args, **kwargs)
        self._train_loader: Any = None
        self._sampler: EpochBatchSampler | None = None
        self._layout: dict[str, int] = {}
        self._run: Run | None = None
        self._ctx: Any = None  # the step in progress (a session.step context)
        self._stepped = False  # its optimizer step was taken: the step ends before the next batch
        self._loss = torch.zeros((), dtype=torch.float64)
        self._grad_norm: Any = None
        self._ended = False
        self._last_loss: float | None = None  # the global loss of the last step
        self._batch_weight: int | None = None  # real samples of the micro-batch handed out last
        self._train_candidate: Any = None  # the unshuffled loader prepare() was given with an optimizer
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------ prepare
    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode=False):
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):  # sharded by the user with fully_shard: no DDP around it
            if model not in self._models:
                self._models.append(model)
            return model
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Accelerate's. Which ``DataLoader`` is the training one: the one with ``shuffle=True``;
        where none is shuffled, the first one handed over in the same call as an optimizer
        (``prepare(model, optimizer, train_loader, eval_loader)``), kept in its dataset's order."""
        loaders = [a for a in args if _map_style(a)]
        if (
            self._train_loader is None
            and loaders
            and any(isinstance(a, torch.optim.Optimizer) for a in args)
            and not any(isinstance(a.sampler, RandomSampler) for a in loaders)
        ):
            self._train_candidate = loaders[0]
        return super().prepare(*args, device_placement=device_placement)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement=None, slice_fn_for_dispatch=None):
        if (
            self._train_loader is None
            and _map_style(data_loader)
            and (isinstance(data_loader.sampler, RandomSampler) or data_loader is self._train_candidate)
        ):
            return self._prepare_train_loader(data_loader, device_placement)
        return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)

    def _prepare_train_loader(self, loader: DataLoader, device_placement: bool | None) -> Any:
        assert loader.batch_size is not None  # prepare_data_loader checked
        s = self.session
        self._layout = {
            "global_batch_size": loader.batch_size * self.num_processes * self.gradient_accumulation_steps,
            "scheduler_steps": self.num_processes,
        }
        g = self._layout["global_batch_size"]
        self._sampler = EpochBatchSampler(
            len(cast(Sized, loader.dataset)),  # a map-style dataset
            g,
            loader.batch_size,
            seed=s.cfg.train.seed,
            rank=s.rank,
            world_size=s.world_size,
            shuffle=shuffled(loader),  # shuffle=False: the dataset's own order, at every world size
        )
        rebuilt = _rebuilt(loader, self._sampler, s.cfg.train.seed + s.rank)
        rebuilt.worker_init_fn = WorkerInit(rebuilt.worker_init_fn)
        put = self.device_placement if device_placement is None else device_placement
        prepared = _api.train_loader(rebuilt, self.device if put else None, self.non_blocking, self._next_batch)
        self._dataloaders.append(prepared)
        self._train_loader = prepared
        return prepared

    def _set_layout(self, layout: dict[str, int]) -> None:
        """The first launch's layout, from a checkpoint: its global batch, split at this world size
        into micro-batches of the loader's ``batch_size`` (a process's forward never grows): the
        accumulation steps follow, the last micro-batch of a step padded where it does not divide."""
        self._layout = layout
        if self._sampler is not None:
            self._sampler.resize(layout["global_batch_size"])
            self.gradient_accumulation_steps = self._sampler.per_step
        for sched in self._schedulers:
            _api.step_per_global_batch(sched, layout["scheduler_steps"])

    def _check_batch(self) -> None:
        """A ``train.global_batch_size`` set on the command line or by the script must be the run's."""
        s, g = self.session, self._layout.get("global_batch_size")
        if g is None or "train.global_batch_size" not in s.explicit or s.cfg.train.global_batch_size == g:
            return
        assert self._sampler is not None  # a layout comes with the training loader's sampler
        raise ConfigError(
            "train.global_batch_size",
            f"{s.cfg.train.global_batch_size}, but this run's global batch is {g} (the training DataLoader's "
            f"batch_size × processes × gradient_accumulation_steps at its first launch; now "
            f"{self._sampler.micro_batch_size} × {self.num_processes} × {self.gradient_accumulation_steps}): "
            "leave the key out or make them agree",
        )

    def prepare_scheduler(self, scheduler: Any):
        prepared = super().prepare_scheduler(scheduler)
        processes: int = self.num_processes
        _api.step_per_global_batch(prepared, self._layout.get("scheduler_steps", processes))
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        prepared = super().prepare_optimizer(optimizer, device_placement)
        step = prepared.step

        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            if not self.sync_gradients or self._stepped:  # accumulating, or a second optimizer
                return step(*args, **kwargs)
            ctx = self._begin_step()
            if not ctx.check(self._loss, self._grad_norm):  # non-finite: no optimizer step (stop at the end)
                self._stepped = True
                return None
            out = step(*args, **kwargs)
            self._stepped = True
            ck = self._the_run()
            ck.hooks.optimizer_stepped(ctx.step)
            ck.state.step = ctx.step
            if self._sampler is not None:
                ctx.record(samples=self._sampler.global_batch_size)
                self._sampler.advance()
            ctx.record(lr=prepared.param_groups[0]["lr"])
            return out

        prepared.step = guarded_step
        return prepared

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The micro-batch's mean loss counts with its real samples' share of the global batch
        (Accelerate divides by the accumulation steps, DDP averages over the processes): 1 where
        the global batch splits evenly, less for a short micro-batch, 0 for a padding one."""
        self._end_step()
        self._begin_step()
        share = self.num_processes * self.gradient_accumulation_steps
        factor = 1.0
        if self._sampler is not None and self._batch_weight is not None:
            factor = self._batch_weight * share / self._sampler.global_batch_size
        self._loss += loss.detach().to(torch.float64).cpu() * factor / share
        super().backward(loss if factor == 1.0 else loss * factor, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        self._grad_norm = super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return self._grad_norm

    def _next_batch(self) -> None:
        """A batch of the training loader is handed out: the previous step ends, this one begins
        (its forward pass inside the hang watchdog)."""
        self._batch_weight = self._sampler.pop_weight() if self._sampler is not None else None
        self._end_step()
        self._begin_step()

    def _begin_step(self) -> Any:
        if self._ctx is None:
            ck = self._the_run()
            self._ctx = self.session.step(ck.state.step + 1, checkpointer=ck).__enter__()
        return self._ctx

    def _end_step(self) -> None:
        """After an optimizer step, before anything of the next one (its batch, its backward, a
        save): agree on preemption and fencing; stop with the protocol's exit code if needed."""
        ctx = self._ctx
        if ctx is None or not self._stepped:
            return
        self._ctx, self._stepped, self._grad_norm = None, False, None
        self._loss = torch.zeros((), dtype=torch.float64)
        ctx.__exit__(None, None, None)
        self._last_loss = ctx.loss
        # the one stop protocol: fenced, preempted, non-finite, a save when the cadence says so
        code = self._the_run().after_step(ctx, sys.maxsize, sampler=self._sampler)
        if code is not None:
            self._ended = True
            raise SystemExit(code)

    # ------------------------------------------------------------------ checkpoints
    def _the_run(self) -> Run:
        if self._run is None:
            models = [self.unwrap_model(m) for m in self._models]
            if len(models) != 1:
                raise ValueError(f"elastic_trainer.accelerate checkpoints one prepared model, found {len(models)}")
            opts = [_api.inner_optimizer(o) for o in self._optimizers]
            scheds = [_api.inner_scheduler(x) for x in self._schedulers]
            extra: dict[str, Stateful] = {f"custom_{i}": obj for i, obj in enumerate(self._custom_objects)}
            if self._sampler is not None:
                extra["sampler"] = self._sampler
                extra["batch_layout"] = _BatchLayout(lambda: self._layout, self._set_layout)
            if self.scaler is not None:
                extra["grad_scaler"] = self.scaler
            self._run = open_run(
                self.session,
                model=models[0],
                optimizer=None if not opts else opts[0] if len(opts) == 1 else {str(i): o for i, o in enumerate(opts)},
                scheduler=None
                if not scheds
                else scheds[0]
                if len(scheds) == 1
                else {str(i): x for i, x in enumerate(scheds)},
                extra=extra,
                # the sample order: a resume with a changed seed is refused (exit 2) naming it
                run_identity={"train.seed": self.session.cfg.train.seed} if self._sampler is not None else None,
            )
        return self._run

    @property
    def completed_steps(self) -> int:
        """Optimizer steps taken in this run, resumed ones included."""
        return self._the_run().state.step

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """An async save of the state after the last optimizer step, committed to
        ``checkpoint.dir`` once every rank's files are written and checksummed. ``output_dir`` is
        recorded in the commit; nothing is written there. Returns the checkpoint root."""
        self._end_step()
        ck = self._the_run()
        if ck.state.step > 0:
            ck.save(ck.state.step, meta={"loss": self._last_loss, "output_dir": output_dir})
            faults.maybe_inject("kill_in_save", ck.state.step)
        return ck.storage.describe()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """``input_dir`` None (or ``checkpoint.dir``): the newest valid commit of this run, or a
        fresh start where there is none. A directory that Accelerate's own ``save_state`` wrote is
        loaded by Accelerate (a warm start from a plain Accelerate checkpoint)."""
        root = self.session.cfg.checkpoint.dir
        if input_dir is not None and os.path.abspath(str(input_dir)) != os.path.abspath(root) and "://" not in root:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        self._the_run().resume()
        self._check_batch()

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """On the prepared training loader after ``load_state()``, the batches of the current epoch
        before the commit's position are already skipped: the usual ``skip_first_batches(loader,
        resume_step)`` of a resumed epoch returns the loader as it is."""
        if dataloader is self._train_loader and self._sampler is not None:
            done = self._sampler.offset
            if num_batches in (0, done):
                return dataloader
            if num_batches < done:
                raise ValueError(
                    f"the training loader already continues at batch {done} of this epoch "
                    f"(load_state restored it); skip_first_batches({num_batches}) would go back"
                )
            return super().skip_first_batches(dataloader, num_batches - done)
        return super().skip_first_batches(dataloader, num_batches)

    # ------------------------------------------------------------------ the end
    def end_training(self) -> None:
        code = self._finish()  # before Accelerate's end, which destroys the process groups
        super().end_training()
        if code:
            raise SystemExit(code)

    def _finish(self) -> int:
        """Every rank, once: the last step's boundary, then the run's end (the last step saved
        unless committed, the bounded wait for its commit): 0, 73 (fenced) or 74 (it did not commit)."""
        if self._ended or self._run is None:
            self._ended = True
            return 0
        self._end_step()
        self._ended = True
        return self._run.finish(meta={"loss": self._last_loss})

    def _at_exit(self) -> None:
        """The script ended without ``end_training()``: the same end, unless it ended by an
        exception (that path starts no collective; the session drains an upload in flight)."""
        if self._ended or getattr(sys, "last_value", None) is not None:
            return
        code = self._finish()
        if code:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
