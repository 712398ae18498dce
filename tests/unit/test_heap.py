"""The collector pause around the control plane's large parses (elastic_trainer.heap)."""

import gc
import threading

import pytest

from elastic_trainer.heap import collector_paused


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_pauses_the_collector_for_the_block_and_restores_it(collector_on):
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: one pause
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_restores_the_collector_after_an_exception(collector_on):
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("parse failed")
    assert gc.isenabled()


def test_leaves_a_collector_the_process_switched_off_switched_off(collector_on):
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_concurrent_blocks_share_one_pause(collector_on):
    """A thread whose block ends first does not switch the collector on under another's parse."""
    inside, release = threading.Event(), threading.Event()
    seen = []

    def other():
        with collector_paused():
            inside.set()
            release.wait(10)
            seen.append(gc.isenabled())

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with collector_paused():
        pass
    assert not gc.isenabled()  # the other block is still parsing
    release.set()
    t.join(10)
    assert seen == [False] and gc.isenabled()
