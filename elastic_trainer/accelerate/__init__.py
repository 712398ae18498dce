"""Hugging Face Accelerate on elastic_trainer: change one import.

    from elastic_trainer.accelerate import Accelerator      # was: from accelerate import Accelerator

Every call keeps its Accelerate meaning; these run on elastic_trainer's machinery (the
:class:`~elastic_trainer.runtime.checkpointer.Checkpointer` of the own-loop API, one step
context per optimizer step):

* the constructor calls :func:`elastic_trainer.init` first (process groups that survive
  restarts under ``elastic-trainer run``, events, metrics, preemption, the hang watchdog), then
  Accelerate's; ``ProjectConfiguration(project_dir=, total_limit=)`` sets ``run.dir``,
  ``checkpoint.dir`` (``project_dir/checkpoints``, unless a supervisor sets them) and
  ``checkpoint.keep_last``;
* ``prepare`` of the training ``DataLoader`` (the one with ``shuffle=True``) gives it a
  world-size-invariant batch sampler: the global batch of the first launch (``batch_size ×
  num_processes × gradient_accumulation_steps``) and its sample order at any world size, the
  position in the checkpoint; a model already sharded with ``fully_shard`` is left as it is;
* ``save_state()`` → an async, verified commit to ``checkpoint.dir`` (any fsspec/S3 root);
  ``load_state()`` → the newest valid commit (resharded, falling back past a damaged one), or a
  fresh start when there is none; the data loader continues where the commit was taken;
* each optimizer step is one step of the own-loop API: the non-finite guard, the hang watchdog,
  step events and metrics, agreed preemption (the final step committed: exit 75, else 76).

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
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from .. import contract, faults
from ..errors import ConfigError
from ..runtime import Checkpointer, init
from ..runtime.epochs import EpochBatchSampler
from ..runtime.loop import WorkerInit, _rebuilt
from . import _api

__all__ = ["Accelerator"]


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
        overrides = []
        if project_dir and not os.environ.get(contract.CONFIG_ENV):  # a supervisor sets the paths itself
            overrides += [f"run.dir={project_dir}", f"checkpoint.dir={os.path.join(project_dir, 'checkpoints')}"]
        if pc is not None and pc.total_limit:
            overrides.append(f"checkpoint.keep_last={pc.total_limit}")
        self.session = init(overrides=overrides)
        if self.session.cfg.train.on_nonfinite != "stop":
            raise ConfigError(
                "train.on_nonfinite",
                "only 'stop' is served under Accelerate: a rollback restarts the loop's iteration, "
                "which the script owns",
            )
        if self.session.device.type == "cpu":  # Accelerate's MULTI_CPU (DDP over gloo) on the session's group
            kwargs["cpu"] = True
        super().__init__(*args, **kwargs)
        self._train_loader: Any = None
        self._sampler: EpochBatchSampler | None = None
        self._layout: dict[str, int] = {}
        self._ckpt: Checkpointer | None = None
        self._ctx: Any = None  # the step in progress (a session.step context)
        self._stepped = False  # its optimizer step was taken: the step ends before the next batch
        self._loss = torch.zeros((), dtype=torch.float64)
        self._grad_norm: Any = None
        self._ended = False
        self._saved_step: int | None = None  # the newest step save_state() saved
        self._last_loss: float | None = None  # the global loss of the last step
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------ prepare
    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode=False):
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):  # sharded by the user with fully_shard: no DDP around it
            if model not in self._models:
                self._models.append(model)
            return model
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement=None, slice_fn_for_dispatch=None):
        if (
            self._train_loader is None
            and isinstance(data_loader, DataLoader)
            and not isinstance(data_loader.dataset, IterableDataset)
            and isinstance(data_loader.sampler, RandomSampler)
            and data_loader.batch_size is not None
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
        )
        rebuilt = _rebuilt(loader, self._sampler, s.cfg.train.seed + s.rank)
        rebuilt.worker_init_fn = WorkerInit(rebuilt.worker_init_fn)
        put = self.device_placement if device_placement is None else device_placement
        prepared = _api.train_loader(rebuilt, self.device if put else None, self.non_blocking, self._next_batch)
        self._dataloaders.append(prepared)
        self._train_loader = prepared
        return prepared

    def _set_layout(self, layout: dict[str, int]) -> None:
        """The first launch's layout, from a checkpoint: split its global batch at this world size."""
        self._layout = layout
        g, w, acc = layout["global_batch_size"], self.num_processes, self.gradient_accumulation_steps
        if g % (w * acc):
            raise ConfigError(
                "elastic.nproc_per_node",
                f"the checkpoint's global batch of {g} samples does not split into {w} processes × "
                f"{acc} accumulation steps: use a number of processes that divides {g // acc}",
            )
        if self._sampler is not None:
            self._sampler.resize(g, g // (w * acc))
        for sched in self._schedulers:
            _api.step_per_global_batch(sched, layout["scheduler_steps"])

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
            ck = self._checkpointer()
            ck.state.step = ctx.step
            if self._sampler is not None:
                self._sampler.advance()
            ctx.record(lr=prepared.param_groups[0]["lr"])
            return out

        prepared.step = guarded_step
        return prepared

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self._end_step()
        self._begin_step()
        share = self.num_processes * self.gradient_accumulation_steps
        self._loss += loss.detach().to(torch.float64).cpu() / share
        super().backward(loss, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        self._grad_norm = super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return self._grad_norm

    def _next_batch(self) -> None:
        """A batch of the training loader is handed out: the previous step ends, this one begins
        (its forward pass inside the hang watchdog)."""
        self._end_step()
        self._begin_step()

    def _begin_step(self) -> Any:
        if self._ctx is None:
            ck = self._checkpointer()
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
        ck = self._checkpointer()
        code = None
        if ctx.fenced:
            code = ck._fenced_exit()  # noqa: SLF001 - our Checkpointer's end path
        elif ctx.preempt:
            code = ck._preempt_exit()  # noqa: SLF001 - our Checkpointer's end path
        elif ctx.nonfinite:
            code = ck._on_nonfinite(ctx.step, ctx.loss, ctx.grad_norm, self._sampler)  # noqa: SLF001 - our Checkpointer's end path
        if code is not None:
            self._ended = True
            ck._close(code)  # noqa: SLF001 - our Checkpointer's end path
            raise SystemExit(code)

    # ------------------------------------------------------------------ checkpoints
    def _checkpointer(self) -> Checkpointer:
        if self._ckpt is None:
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
            self._ckpt = Checkpointer(
                self.session,
                model=models[0],
                optimizer=None if not opts else opts[0] if len(opts) == 1 else {str(i): o for i, o in enumerate(opts)},
                scheduler=None
                if not scheds
                else scheds[0]
                if len(scheds) == 1
                else {str(i): x for i, x in enumerate(scheds)},
                extra=extra,
            )
        return self._ckpt

    @property
    def completed_steps(self) -> int:
        """Optimizer steps taken in this run, resumed ones included."""
        return self._checkpointer().state.step

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """An async save of the state after the last optimizer step, committed to
        ``checkpoint.dir`` once every rank's files are written and checksummed. ``output_dir`` is
        recorded in the commit; nothing is written there. Returns the checkpoint root."""
        self._end_step()
        ck = self._checkpointer()
        if ck.state.step > 0:
            ck._save(ck.state.step, meta={"loss": self._last_loss, "output_dir": output_dir})  # noqa: SLF001 - our Checkpointer's end path
            self._saved_step = ck.state.step
            faults.maybe_inject("kill_in_save", ck.state.step)
        return ck.storage.describe()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """``input_dir`` None (or ``checkpoint.dir``): the newest valid commit of this run, or a
        fresh start where there is none. A directory that Accelerate's own ``save_state`` wrote is
        loaded by Accelerate (a warm start from a plain Accelerate checkpoint)."""
        root = self.session.cfg.checkpoint.dir
        if input_dir is not None and os.path.abspath(str(input_dir)) != os.path.abspath(root) and "://" not in root:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        self._checkpointer().resume()

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
        """Every rank, once: the last step's boundary, then wait (bounded) for the last commit:
        0, 73 (fenced) or 74 (the last save did not commit)."""
        if self._ended or self._ckpt is None:
            self._ended = True
            return 0
        self._end_step()
        self._ended = True
        ck = self._ckpt
        ck._final_saved = self._saved_step  # noqa: SLF001 - our Checkpointer's end path; the last save must commit (else 74)
        code = ck._finish()  # noqa: SLF001 - our Checkpointer's end path
        ck._close(code)  # noqa: SLF001 - our Checkpointer's end path
        return code

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
