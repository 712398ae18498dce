"""elastic_trainer's guarantees inside a Lightning ``Trainer``: one strategy, two changed lines.

    from elastic_trainer.lightning import Strategy  # was: ...strategies import ModelParallelStrategy
    trainer = L.Trainer(strategy=Strategy(), ...)   # was: strategy=ModelParallelStrategy(...)

:class:`Strategy` is Lightning's FSDP2 ``ModelParallelStrategy`` (the module's ``configure_model``
calls ``fully_shard`` over ``self.device_mesh["data_parallel"]``) driven by the same machinery as
elastic_trainer's own loop: :func:`elastic_trainer.init` (process groups, events, metrics,
preemption, the hang watchdog), :class:`~elastic_trainer.runtime.run.Run` (async DCP saves on the
cadence, the commit protocol, verified loads with fallback, compatibility refusals, the agreed
preemption exit, the non-finite guard, the run's end) and a
:class:`~elastic_trainer.GlobalBatchSampler` for the train dataloader. Each optimizer step is one
``session.step`` scope, opened at ``on_train_batch_start`` and ended at ``on_train_batch_end``
with the run's ``after_step`` — the one stop protocol of every front end. See docs/lightning.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from .. import contract, exit_codes, faults
from ..errors import ConfigError
from ..runtime.loop import WorkerInit, _rebuilt, resumed_global_batch, shuffled
from ..runtime.run import Run, open_run
from ..runtime.sampler import GlobalBatchSampler
from ..runtime.session import Session, init
from ..runtime.step import StepContext
from . import private

logger = logging.getLogger(__name__)

__all__ = ["Strategy"]


class Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with elastic_trainer's guarantees (see the module's docstring).

    ``config``/``overrides``: as for :func:`elastic_trainer.init` (under ``elastic-trainer run`` the
    supervisor's config is the base). The data-parallel size is the world size, whatever
    ``Trainer(devices=, num_nodes=)`` say (a restart may bring another world size); tensor
    parallelism is not served. ``kwargs`` go to ``ModelParallelStrategy`` (``timeout``,
    ``process_group_backend``, ``save_distributed_checkpoint`` for ``trainer.save_checkpoint``)."""

    def __init__(self, config: Any = None, *, overrides: list[str] | tuple[str, ...] = (), **kwargs: Any):
        super().__init__(**kwargs)
        self._asked_tp = kwargs.get("tensor_parallel_size", "auto")
        self._et_config, self._et_overrides = config, tuple(overrides)
        self.session: Session | None = None
        self.ckpt: Run | None = None
        self._data = _DataPosition()
        self._hooks = _Hooks(
            train_start=self._install_preemption,
            before_optimizer_step=self._check,
            batch_end=self._step_done,
            train_end=self._train_end,
            failed=self._end_step,
        )
        self._ctx: StepContext | None = None
        self._weight = 0.0  # this rank's share of the global batch in the step's loss
        self._loss_share: torch.Tensor | None = None
        self._state_only = False  # dumping Lightning's own state: leave weights and optimizer out
        self._total: int | None = None  # the fit's last optimizer step
        self._ended = False  # the run's end is recorded (a final commit waited for, or a stop)
        self._local_world = int(os.environ.get(contract.LOCAL_WORLD_SIZE_ENV, "1"))
        self._user_accumulation: int | None = None  # the Trainer's accumulate_grad_batches as the user set it

    # ------------------------------------------------------------------ the world
    @property
    def num_nodes(self) -> int:
        """Nodes of this launch (from the launcher, not the Trainer: a restart may change them)."""
        return max(1, int(os.environ.get(contract.WORLD_SIZE_ENV, "1")) // self._local_world)

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:  # the Trainer's num_nodes= is overridden by the launcher's world
        pass

    def _configure_launcher(self) -> None:
        """Lightning never starts workers: they are the launcher's (``elastic-trainer run``,
        ``torchrun``, a SLURM step), else this process is a world of one."""
        self._launcher = None

    def setup_environment(self) -> None:
        """``elastic_trainer.init`` first (process groups — Lightning then finds them initialised —,
        events, metrics, preemption flag, watchdog), then Lightning's own set-up over a
        ``(world, 1)`` mesh: every rank data-parallel."""
        if self.parallel_devices is None or len(self.parallel_devices) != self._local_world:
            kind = self.parallel_devices[0].type if self.parallel_devices else "cpu"
            self.parallel_devices = [
                torch.device(kind, i) if kind != "cpu" else torch.device("cpu") for i in range(self._local_world)
            ]
        assert self.lightning_module is not None  # attached by the Trainer
        if self.session is None:  # once per process (a validate/test after fit reuses it)
            self.session = init(self._et_config, overrides=self._et_overrides)
            self._trainer_state = _TrainerState(self._states_only, self.lightning_module.trainer)
        self._data_parallel_size, self._tensor_parallel_size = self.session.world_size, 1
        super().setup_environment()
        trainer = self.lightning_module.trainer
        # the Trainer's callbacks: set by its callback connector, undeclared in Lightning's types
        if self._hooks not in trainer.callbacks:  # type: ignore[attr-defined]
            trainer.callbacks.append(self._hooks)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ model, optimizers, resume
    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's set-up (the module's ``configure_model`` has sharded it, the optimizers
        exist), then: gradients reduced as a SUM (the loss carries each rank's share of the global
        batch, so the gradient is the global mean at any world size), the checkpointer over the
        module, optimizers, schedulers, per-rank RNG, the data position and Lightning's own state,
        and the resume from the newest valid commit; Lightning then restores its loops, callbacks
        and precision plugin from it in its own restore step."""
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        s = self.session
        assert s is not None  # setup_environment made it
        _check_supported(trainer, s, self._asked_tp)
        if self._user_accumulation is None:  # the user's, before this strategy sets it per world size
            self._user_accumulation = trainer.accumulate_grad_batches
        module = self.lightning_module
        assert module is not None  # attached by the Trainer
        _sum_reduction(module)
        optimizers = list(self.optimizers)
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        t = s.cfg.train
        self.ckpt = open_run(
            s,
            model=module,
            optimizer=optimizers[0] if len(optimizers) == 1 else {f"opt{i}": o for i, o in enumerate(optimizers)},
            scheduler=None
            if not schedulers
            else schedulers[0]
            if len(schedulers) == 1
            else {f"sched{i}": x for i, x in enumerate(schedulers)},
            extra={"sampler": self._data, "lightning": self._trainer_state},
            # the sample order (and the global batch where it was set): a resume with one changed
            # is refused (exit 2) naming it; the sampler's state keeps the first launch's batch
            run_identity={
                "train.seed": t.seed,
                **({"train.global_batch_size": t.global_batch_size} if "train.global_batch_size" in s.explicit else {}),
            },
        )
        self.ckpt.resume()
        loaded = self._trainer_state.loaded
        if loaded is not None:
            loaded["lr_schedulers"] = [x.state_dict() for x in schedulers]  # ours, restored above
            private.restore_trainer_state(trainer, loaded)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self._state_only else super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {} if self._state_only else super().optimizer_state(optimizer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """``fit(ckpt_path=...)``: a commit of this run's lineage wins (it is newer and verified;
        the path is ignored, with a warning); without one the path loads as Lightning would (a
        plain-Lightning checkpoint as the starting point)."""
        if self.ckpt is not None and self.ckpt.loaded is not None:
            logger.warning(
                "ckpt_path=%s ignored: resumed from the committed step %d of this run",
                checkpoint_path,
                self.ckpt.loaded.step,
            )
            return self._trainer_state.loaded or {}
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        """The train dataloader over a map-style dataset: the same dataset, ``collate_fn``,
        workers and the rest, with a :class:`GlobalBatchSampler` as its batch sampler (Lightning's
        ``DistributedSampler`` is dropped): ``train.global_batch_size`` samples per step at every
        world size, split across ranks, from the checkpointed cursor. Evaluation loaders and
        iterable datasets are left as Lightning made them."""
        from torch.utils.data import DataLoader, IterableDataset

        assert self.lightning_module is not None  # attached by the Trainer
        trainer = self.lightning_module.trainer
        if (
            trainer.state.stage != RunningStage.TRAINING
            or not isinstance(dataloader, DataLoader)
            or isinstance(dataloader.dataset, IterableDataset)
        ):
            return dataloader
        s = self.session
        assert s is not None  # setup_environment made it
        t = s.cfg.train
        micro = dataloader.batch_size  # every rank's forward, at every world size
        if micro is None:
            raise ConfigError("train_dataloader", "the train DataLoader needs a batch_size: every rank's micro-batch")
        global_batch = self._global_batch(micro)
        sampler = _EpochSampler(
            len(cast(Sized, dataloader.dataset)),  # a map-style dataset
            global_batch,
            micro,
            seed=t.seed,
            rank=s.rank,
            world_size=s.world_size,
            shuffle=shuffled(dataloader),  # shuffle=False: the dataset's own order, kept at every world size
        )
        self._data.attach(sampler)  # a resume's position (and the batch it recorded, replaced by the run's)
        sampler.resize(global_batch)
        self._accumulate(trainer, sampler.per_step)
        loader = _rebuilt(dataloader, sampler, t.seed + s.rank)
        loader.worker_init_fn = WorkerInit(loader.worker_init_fn)
        return loader

    def _global_batch(self, micro: int) -> int:
        """This run's global batch: its checkpoint's (see :func:`.loop.resumed_global_batch`), or
        a first launch's."""
        s, recorded = self.session, self._data.recorded_global_batch
        assert s is not None  # set up
        if not self._data.resumed:
            return self._first_global_batch(micro)
        if recorded is None:  # a checkpoint from before the global batch was recorded: it ran with the key's
            return s.cfg.train.global_batch_size
        batch_set = "train.global_batch_size" in s.explicit
        return resumed_global_batch(recorded, s.cfg.train, s.cfg.checkpoint.allow_changes, batch_set)

    def _first_global_batch(self, micro: int) -> int:
        """The global batch of a first launch: the loader's ``batch_size`` × processes ×
        ``accumulate_grad_batches``; a ``train.global_batch_size`` set on the command line or by the
        script must agree (exit 2 naming both). A resume takes its checkpoint's instead (and the
        run identity holds a set value to it)."""
        s = self.session
        assert s is not None and self._user_accumulation is not None  # set up
        mine = micro * s.world_size * self._user_accumulation
        if "train.global_batch_size" in s.explicit and s.cfg.train.global_batch_size != mine:
            raise ConfigError(
                "train.global_batch_size",
                f"{s.cfg.train.global_batch_size}, but the train DataLoader's batch_size × processes × "
                f"accumulate_grad_batches is {micro} × {s.world_size} × {self._user_accumulation} = {mine}: "
                "leave the key out or make them agree",
            )
        return mine

    def _accumulate(self, trainer: pl.Trainer, per_step: int) -> None:
        """The Trainer accumulates this world size's micro-batches per step; a resume from another
        world size has its epoch's batch count restored in the saved accumulation's micro-batches."""
        saved = self._trainer_state.saved_accumulation
        if saved is not None and saved != per_step:
            private.rescale_batch_progress(trainer, saved, per_step)
        self._trainer_state.saved_accumulation = None  # once: a later dataloader reload is of this run
        trainer.accumulate_grad_batches = per_step

    # ------------------------------------------------------------------ one step
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first micro-batch of an optimizer step opens its step scope (hang watchdog, fault
        injection); every micro-batch's loss counts with its real samples' share of the global
        batch (Lightning divides it by the accumulation steps first; 0 for a padding one)."""
        super().on_train_batch_start(batch, batch_idx)
        assert self.lightning_module is not None and self.session is not None  # attached; set up
        trainer = self.lightning_module.trainer
        if self._ctx is None:
            self._ctx = self.session.step(trainer.global_step + 1, checkpointer=self.ckpt).__enter__()
            self._loss_share = torch.zeros((), dtype=torch.float64, device=self.root_device)
        sampler = self._data.sampler
        self._weight = (
            sampler.pop_weight() * trainer.accumulate_grad_batches / sampler.global_batch_size
            if sampler is not None
            else 1.0 / self.session.world_size
        )

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The rank's mean loss counts with its share of the global batch (gradients are summed)."""
        if self._ctx is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self._loss_share is not None  # made with the step's context
        if faults.active("nan", self._ctx.step):
            closure_loss = closure_loss * float("nan")
        self._loss_share += closure_loss.detach().to(torch.float64) * self._weight
        return super().backward(closure_loss * self._weight, optimizer, *args, **kwargs)

    def teardown(self) -> None:
        self._end_step(None)
        super().teardown()

    def _check(self, optimizer: Any) -> None:
        """Before the optimizer step: the staging wait and the agreed non-finite guard (the loss,
        and the gradient norm unless a grad scaler — ``16-mixed`` — handles overflowing
        gradients itself); a non-finite step leaves every gradient None, so the optimizer changes
        nothing. The step event's ``lr`` is the rate this optimizer step uses."""
        ctx = self._ctx
        if ctx is None:
            return
        assert self.lightning_module is not None and self._loss_share is not None  # attached; with the context
        norm = None
        if getattr(self.precision_plugin, "scaler", None) is None:
            grads = [p.grad for p in self.lightning_module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.root_device)
        if not ctx.check(self._loss_share, norm):
            optimizer.zero_grad(set_to_none=True)
        ctx.record(lr=optimizer.param_groups[0]["lr"])  # the step's own: schedulers step before on_train_batch_end

    def _step_done(self, trainer: pl.Trainer) -> None:
        """``on_train_batch_end``: the step's bookkeeping, the agreement, then ``end_of_step``."""
        ctx, ck = self._ctx, self.ckpt
        if ctx is None or trainer.global_step < ctx.step:  # no step, or more micro-batches to accumulate
            return
        assert ck is not None  # a step's context is opened when fitting, with a checkpointer
        if not ctx.nonfinite:
            ck.hooks.optimizer_stepped(ctx.step)
            ck.state.step = ctx.step
            if self._data.sampler is not None:
                ctx.record(samples=self._data.sampler.global_batch_size)
                self._data.sampler.advance()
        self._end_step(None)
        if self._total is None:
            total = trainer.estimated_stepping_batches
            self._total = int(total) if total != float("inf") else sys.maxsize
        code = ck.after_step(ctx, self._total)
        if code is not None:
            self._ended = True
            if code != exit_codes.OK or ctx.step == ck.audit_stop:  # a replay of `ckpt audit` ends there
                raise SystemExit(code)

    @contextlib.contextmanager
    def _states_only(self) -> Iterator[None]:
        """While Lightning's own state is dumped: the weights and optimizer are left out."""
        self._state_only = True
        try:
            yield
        finally:
            self._state_only = False

    def _install_preemption(self) -> None:
        """``on_train_start``: Lightning's signal connector has just put its SIGTERM handler (and,
        on SLURM with auto-requeue, a SIGUSR1 handler that saves from inside the handler) in front
        of ours: preemption is agreed at a step boundary instead, then the final step committed."""
        assert self.session is not None  # setup_environment made it
        self.session.preempt.install()

    def _train_end(self) -> None:
        """``on_train_end``: the fit ended without the final step's end (resumed at the end, an
        early stop): the run's end — the last step saved unless committed, its commit waited for."""
        if self.ckpt is not None and not self._ended:
            self._ended = True
            code = self.ckpt.finish()
            if code != exit_codes.OK:
                raise SystemExit(code)

    def _end_step(self, exc: BaseException | None) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)


class _Hooks(Callback):
    """The strategy's hooks that Lightning gives callbacks only (added by the strategy, which
    hands over the methods that serve them)."""

    def __init__(
        self,
        *,
        train_start: Callable[[], None],
        before_optimizer_step: Callable[[Any], None],
        batch_end: Callable[[pl.Trainer], None],
        train_end: Callable[[], None],
        failed: Callable[[BaseException | None], None],
    ):
        self._train_start, self._before_optimizer_step = train_start, before_optimizer_step
        self._batch_end, self._train_end, self._failed = batch_end, train_end, failed

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_start()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._before_optimizer_step(optimizer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._batch_end(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_end()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """An exception starts no checkpoint: a save already uploading gets its bounded drain."""
        self._failed(exception)


_ACCUMULATION = "elastic_trainer_accumulate_grad_batches"  # beside Lightning's own keys in its state


class _TrainerState(Stateful):
    """Lightning's own state — loops (epoch, global step, batch progress), callbacks' state, the
    precision plugin (grad scaler), hyper-parameters, what ``on_save_checkpoint`` hooks add — as
    one object, the same on every rank (saved once). The weights and optimizer states are saved
    sharded beside it; LR schedulers by the checkpointer (as JSON)."""

    def __init__(self, states_only: Callable[[], contextlib.AbstractContextManager[None]], trainer: pl.Trainer):
        self.states_only, self.trainer = states_only, trainer
        self.loaded: dict[str, Any] | None = None
        self.saved_accumulation: int | None = None  # the accumulation steps of the loaded state's loops

    def state_dict(self) -> dict[str, Any]:
        import io

        with self.states_only():
            state = private.trainer_state(self.trainer)
        for key in ("state_dict", "optimizer_states", "lr_schedulers"):
            state.pop(key, None)
        state[_ACCUMULATION] = self.trainer.accumulate_grad_batches  # what the loops' batch counts count in
        buf = io.BytesIO()
        torch.save(state, buf)
        return {"state": buf.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        import io

        # the bytes were verified against the manifest's checksums before this load
        self.loaded = torch.load(io.BytesIO(state_dict["state"]), weights_only=False)
        self.saved_accumulation = self.loaded.pop(_ACCUMULATION, 1)  # earlier: one batch per step
        self.loaded.setdefault("state_dict", {})
        self.loaded.setdefault("optimizer_states", [])


class _DataPosition(Stateful):
    """The train data's position (the sampler's cursor and skipped ranges) and the run's global
    batch. Lightning builds the train dataloader after the resume, so a loaded position waits for
    the sampler."""

    optional_on_load = GlobalBatchSampler.optional_on_load

    def __init__(self) -> None:
        self.sampler: GlobalBatchSampler | None = None
        self._pending: dict[str, Any] | None = None

    @property
    def resumed(self) -> bool:
        return self._pending is not None

    @property
    def recorded_global_batch(self) -> int | None:
        """The global batch a loaded checkpoint recorded (None: a fresh start, or a checkpoint from
        before it was recorded)."""
        recorded = (self._pending or {}).get("global_batch_size")
        return int(recorded) if recorded is not None else None

    def attach(self, sampler: GlobalBatchSampler) -> None:
        self.sampler = sampler
        if self._pending is not None:
            sampler.load_state_dict(self._pending)

    def state_dict(self) -> dict[str, Any]:
        if self.sampler is not None:
            return self.sampler.state_dict()
        zero = torch.tensor(0, dtype=torch.int64)
        return self._pending or {"cursor": zero, "skipped": "[]", "global_batch_size": zero.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = {"cursor": torch.tensor(int(state_dict["cursor"])), "skipped": state_dict.get("skipped", "[]")}
        if state_dict.get("global_batch_size") is not None:
            self._pending["global_batch_size"] = torch.tensor(int(state_dict["global_batch_size"]))
        if self.sampler is not None:
            self.sampler.load_state_dict(self._pending)


class _EpochSampler(GlobalBatchSampler):
    """A :class:`GlobalBatchSampler` with a length: Lightning's epoch is ``len(dataset) //
    global_batch`` steps of this world size's micro-batches per step (the global order itself
    runs on across epochs)."""

    def __len__(self) -> int:
        return max(1, self.order.n // self.global_batch_size) * self.per_step


def _sum_reduction(module: torch.nn.Module) -> None:
    """Every ``fully_shard``ed module reduces gradients as a SUM; every parameter must be sharded
    (an unsharded one would never see the other ranks' gradients)."""
    from torch.distributed.fsdp import FSDPModule

    unsharded = [n for n, p in module.named_parameters() if not isinstance(p, DTensor)]
    if unsharded:
        raise ConfigError(
            "configure_model",
            f"parameters left unsharded: {', '.join(unsharded[:5])}; fully_shard every block and the root "
            'over self.device_mesh["data_parallel"]',
        )
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _check_supported(trainer: pl.Trainer, session: Session, asked_tp: Any) -> None:
    """What this strategy does not serve stops before the first step (exit 2), by name."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    problems = []
    if asked_tp not in ("auto", 1):
        problems.append(("tensor_parallel_size", "tensor parallelism is not served: every rank is data-parallel"))
    # the Trainer's callbacks: set by its callback connector, undeclared in Lightning's types
    if any(isinstance(c, OnExceptionCheckpoint) for c in trainer.callbacks):  # type: ignore[attr-defined]
        problems.append(
            ("OnExceptionCheckpoint", "it saves from the exception path; the newest commit is what a restart loads")
        )
    if not trainer.lightning_module.automatic_optimization:
        problems.append(("automatic_optimization", "manual optimization is not served: one optimizer step per batch"))
    if session.cfg.train.on_nonfinite != "stop":
        problems.append(
            (
                "train.on_nonfinite",
                f"only 'stop' is served under Lightning (got {session.cfg.train.on_nonfinite!r}): a rollback or a "
                "replay rewinds the loop, which Lightning's loops cannot",
            )
        )
    if problems:
        key, why = problems[0]
        raise ConfigError(key, why)
