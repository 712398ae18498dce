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


def test_checkpoint_writer_defaults_to_thread():
    # accepted as "process" where torch runs it: tests/unit/test_config.py's process-writer test
    assert config_from_dict({}).checkpoint.writer == "thread"


class _Stateful:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"v": self.value}

    def load_state_dict(self, sd):
        self.value = sd["v"]


class _NowStager:
    def stage(self, sd):
        from concurrent.futures import Future

        f = Future()
        f.set_result(dict(sd))
        return f


def test_uploads_reuse_one_thread_and_a_save_beside_a_stuck_upload_gets_its_own():
    import threading

    from elastic_trainer.checkpoint.savers import _Uploads

    release = threading.Event()
    seen: list[tuple[str, dict]] = []

    def save(stuck):
        def run(staged):
            if stuck:
                assert release.wait(30)
            seen.append((threading.get_ident(), staged))
            return staged

        return run

    up = _Uploads("t-upload")
    try:
        names = []
        for i in range(3):  # one after the other: one thread, kept
            staging, written = up.start({"a": _Stateful(i), "plain": i}, _NowStager(), save(False))
            assert staging.result(5) == {"a": {"v": i}, "plain": i}  # state dicts taken on the caller
            assert written.result(5) == {"a": {"v": i}, "plain": i}
            names.append(seen[-1][0])
        assert len(set(names)) == 1
        _, stuck = up.start({"a": _Stateful("stuck")}, _NowStager(), save(True))
        _, beside = up.start({"a": _Stateful("next")}, _NowStager(), save(False))
        assert beside.result(10) == {"a": {"v": "next"}}  # did not queue behind the stuck upload
        assert not stuck.done()
        assert seen[-1][0] != names[0]
        release.set()
        assert stuck.result(10) == {"a": {"v": "stuck"}}
    finally:
        release.set()
        up.close()
