"""Where a save is staged and written: the stager's options (one mechanism for CPU and CUDA)
and the ``checkpoint.writer`` key."""

from __future__ import annotations

import pytest

from elastic_trainer.checkpoint.savers import staging_options
from elastic_trainer.config import config_from_dict
from elastic_trainer.errors import ConfigError


@pytest.mark.parametrize(
    "cuda, shared, pinned_nonblocking",
    [(False, False, False), (False, True, False), (True, False, True), (True, True, True)],
)
def test_staging_is_always_in_the_background_pinned_only_for_cuda_shared_only_for_the_process_writer(
    cuda, shared, pinned_nonblocking
):
    o = staging_options(cuda=cuda, shared_memory=shared)
    assert o.use_async_staging is True
    assert (o.use_pinned_memory, o.use_non_blocking_copy) == (pinned_nonblocking, pinned_nonblocking)
    assert o.use_shared_memory is shared


def test_the_cpu_stager_options_build_a_working_stager():
    """The CPU combinations must construct (torch refuses pinned memory without an accelerator)."""
    from torch.distributed.checkpoint.staging import DefaultStager

    for shared in (False, True):
        DefaultStager(staging_options(cuda=False, shared_memory=shared)).close()


@pytest.mark.parametrize(
    "checkpoint, message",
    [({"writer": "fork"}, "expected thread or process"), ({"writer": "process", "dir": "memory://ckpt"}, "memory://")],
)
def test_checkpoint_writer_is_checked_where_the_config_is_built(checkpoint, message):
    with pytest.raises(ConfigError, match=f"checkpoint.writer.*{message}"):
        config_from_dict({"checkpoint": checkpoint})


def test_checkpoint_writer_defaults_to_thread_and_accepts_process():
    assert config_from_dict({}).checkpoint.writer == "thread"
    assert config_from_dict({"checkpoint": {"writer": "process"}}).checkpoint.writer == "process"
