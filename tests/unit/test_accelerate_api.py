"""The Accelerate internals elastic_trainer.accelerate relies on (elastic_trainer/accelerate/_api.py):
each test fails loudly, naming what changed, when an Accelerate release changes one of them."""

from __future__ import annotations

import inspect

import accelerate
import pytest
import torch
from accelerate.data_loader import DataLoaderShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState, GradientState

from elastic_trainer.accelerate import _api
from elastic_trainer.runtime.epochs import EpochBatchSampler


@pytest.fixture
def state():
    accelerate.Accelerator(cpu=True)  # Accelerate's own, a world of one: the state its wrappers read
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_wrapped_optimizer_and_scheduler_are_their_attributes(state):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    acc_opt = AcceleratedOptimizer(opt, device_placement=False)
    acc_sched = AcceleratedScheduler(sched, acc_opt, step_with_optimizer=True, split_batches=False)
    assert _api.inner_optimizer(acc_opt) is opt, "AcceleratedOptimizer.optimizer is no longer the wrapped optimizer"
    assert _api.inner_scheduler(acc_sched) is sched, "AcceleratedScheduler.scheduler is no longer the wrapped one"


def test_split_batches_steps_the_scheduler_once_and_the_wrapper_the_first_launchs_count(state):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0)
    acc_opt = AcceleratedOptimizer(opt, device_placement=False)
    acc_sched = AcceleratedScheduler(sched, acc_opt, step_with_optimizer=True, split_batches=False)
    assert hasattr(acc_sched, "split_batches") and hasattr(acc_sched, "step_with_optimizer")
    assert hasattr(acc_sched, "gradient_state") and acc_sched.gradient_state.sync_gradients
    acc_opt.step()
    _api.step_per_global_batch(acc_sched, 3)
    acc_sched.step()
    assert sched.last_epoch == 3, "split_batches no longer makes one AcceleratedScheduler.step() one inner step"


def test_a_data_loader_shard_is_built_around_our_batch_sampler_and_calls_the_hook(state):
    params = inspect.signature(DataLoaderShard.__init__).parameters
    for name in ("device", "_non_blocking"):
        assert name in params, f"DataLoaderShard.__init__ lost {name!r}"
    sampler = EpochBatchSampler(12, 4, 2, seed=0, rank=0, world_size=2)
    loader = torch.utils.data.DataLoader(list(range(12)), batch_sampler=sampler)
    calls = []
    shard = _api.train_loader(loader, None, False, lambda: calls.append(1))
    assert isinstance(shard, DataLoaderShard) and shard.batch_sampler is sampler
    batches = [b.tolist() for b in shard]
    assert batches == [list(x) for x in sampler] and len(calls) == len(batches) == len(shard) == 3
