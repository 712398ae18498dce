"""Fakes shared by the single-process tests of the save machine and of a run's ends: a
``Stateful`` holding one tensor, a checkpoint.dir saver gated by the test, and an agreement that
plays the other ranks' answers."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch
import torch.distributed.checkpoint as dcp

from elastic_trainer.checkpoint import integrity
from elastic_trainer.checkpoint.savers import ProcessWriterSaver, RemoteSaver, Started

WAIT = 10.0  # seconds any single wait in these tests may take at most


class Weights:
    """A Stateful holding one tensor."""

    def __init__(self, value: float = 0.0):
        self.w = torch.full((4,), value)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, sd):
        self.w = sd["w"].clone()


class GatedSaver(ProcessWriterSaver):
    """A checkpoint.dir saver whose staging and writing each wait for the test's go-ahead.

    ``writer``: "fake" copies the state when staging is released and writes it as a real
    checksummed DCP checkpoint (single process) when writing is released; "thread" is the real
    thread writer (:class:`RemoteSaver`), started when staging is released, its end held until
    writing is released. Either fails with the exception given to :meth:`fail`. It writes as the
    thread writer does unless a test sets ``uses_writer_process``: then the process writer's
    policy (:meth:`ProcessWriterSaver.check`) is the real one, with the writer processes stubbed
    (no writer process runs in one process)."""

    def __init__(self, storage, *, writer="fake", hold_staging: bool = False, hold_writing: bool = True):
        super().__init__(storage, None)
        self.uses_writer_process = False
        self.thread_writer = RemoteSaver(storage, None) if writer == "thread" else None
        self.hold_staging, self.hold_writing = hold_staging, hold_writing
        self.started: list[str] = []
        self._gates: dict[str, tuple[threading.Event, threading.Event, list]] = {}
        self._threads: dict[str, threading.Thread] = {}
        self.failures_seen = 0
        self.closed = False

    def start(self, save, states, manifest):
        name = save.name
        self.started.append(name)
        staged, go, error = threading.Event(), threading.Event(), []
        self._gates[name] = (staged, go, error)
        if not self.hold_staging:
            staged.set()
        if not self.hold_writing:
            go.set()
        staging, written = Future(), Future()

        def run():
            staged.wait(WAIT)
            if self.closed:  # the test ended with this save held: write nothing after the saver closed
                staging.set_result(None)
                written.set_exception(RuntimeError("the saver closed"))
                return
            if self.thread_writer is not None:
                inner = self.thread_writer.start(save, states, manifest)
                if inner.staging is not None:  # None: it could not start (its done future says why)
                    inner.staging.result(WAIT)
            else:
                copy = {k: {"w": v.state_dict()["w"].clone()} for k, v in states.items()}
            staging.set_result(None)
            go.wait(WAIT)
            if error:
                if self.thread_writer is not None:  # a real write fails as its DCP save ends, never beside the next
                    inner.done.exception(WAIT)
                written.set_exception(error[0])
                return
            try:
                if self.thread_writer is not None:
                    inner.done.result(WAIT)
                else:
                    writer = integrity.ChecksummedWriter(self.storage.dcp.writer(self.storage.join(name)))
                    dcp.save(copy, storage_writer=writer, no_dist=True)
                written.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed to the manager like DCP would
                written.set_exception(e)

        self._threads[name] = threading.Thread(target=run, daemon=True)
        self._threads[name].start()
        return Started(staging, written)

    def join(self, name):
        """Until the write of ``name`` has ended and its callbacks have run (they run on its thread)."""
        self._threads[name].join(WAIT)
        assert not self._threads[name].is_alive()

    def stage(self, name):
        self._gates[name][0].set()

    def release(self, name):
        self._gates[name][1].set()

    def fail(self, name, exc: BaseException):
        self._gates[name][2].append(exc)
        self._gates[name][1].set()

    def reset(self):
        self.failures_seen += 1
        super().reset()

    def close(self):
        self.closed = True
        for staged, go, _ in self._gates.values():
            staged.set()
            go.set()
        if self.thread_writer is not None:
            self.thread_writer.close()
        super().close()


class ScriptedAgreement:
    """One rank's view of the agreement; ``others`` is what the other ranks answer to
    ``all_true`` (True: they agree with this rank), ``answers`` their answers to the next calls
    in turn (then ``others`` again)."""

    def __init__(self):
        self.others = True
        self.answers: list[bool] = []
        self.calls = 0

    def all_true(self, flag, *, control=True):
        self.calls += 1
        return bool(flag) and (self.answers.pop(0) if self.answers else self.others)

    def broadcast(self, obj):
        return obj

    def gather(self, obj):
        return [obj]
