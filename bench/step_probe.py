"""Per-phase timeline of every training step, recorded inside the worker (used by bench/step_phases.py).

Loaded into every Python process of a run through a ``sitecustomize`` that bench/step_phases.py
puts on ``PYTHONPATH`` (``ET_STEP_PROBE=<dir>``); it does nothing until the worker imports
``elastic_trainer.runtime.step``, then wraps, without changing what they do: ``StepContext``
(enter, ``agree``, ``check``, ``_emit``), ``Tensor.backward``, ``clip_grad_norm_``, the
optimizer's step (torch's global optimizer hooks), ``CheckpointManager.wait_for_staging`` and
``CheckpointManager.save``. Each step appends one JSON line to ``<dir>/<pid>.jsonl``: the wall
time of each phase (the time since the previous mark, attributed to the mark reached), the
training thread's CPU time (``time.thread_time``), its page faults and context switches
(``getrusage(RUSAGE_THREAD)``), the process's page faults, and the CPU time of the process's
other threads (``/proc/self/task``); ``saved``: a save was started right after this step.

``ET_STEP_PROBE_PIN=1``: the training thread is pinned to CPU 0 and every other thread of the
worker (stager, upload, commit, gloo) to CPU 1 (``sched_setaffinity`` on native thread ids,
checked at each step start). ``ET_STEP_PROBE_IDLE=1``: every thread but the training thread
runs under ``SCHED_IDLE``. ``ET_STEP_PROBE_SWITCH=S``: ``sys.setswitchinterval(S)`` in the worker.
``ET_STEP_PROBE_PROFILE=1``: cProfile of the save calls after step 11, in ``<dir>/<pid>.save.pstats``.
``ET_STEP_PROBE_DCP_STAGER=1``: DCP's ``DefaultStager`` (a deep copy every save) instead of ours.
``ET_STEP_PROBE_SYNC_STAGING=1``: the stager copies on the training thread, inside the save call.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import resource
import sys
import threading
import time

_TICK = os.sysconf("SC_CLK_TCK")


def _other_threads_cpu(main_tid: int) -> float:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == main_tid:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            total += int(parts[11]) + int(parts[12])  # utime, stime (fields 14, 15)
        except (OSError, IndexError, ValueError):
            pass
    return total / _TICK


class _Probe:
    def __init__(self, out: str):
        self.dir = out
        self.out = None  # opened by the first step: the zygote imports this before forking workers
        self.pin = os.environ.get("ET_STEP_PROBE_PIN") == "1"
        self.idle = os.environ.get("ET_STEP_PROBE_IDLE") == "1"
        self.placed: set[int] = set()
        self.active = False
        self.saved_pending = False
        self.last_end = None
        self.save_seconds = 0.0

    def start(self, step: int) -> None:
        if self.out is None:
            self.out = open(os.path.join(self.dir, f"{os.getpid()}.jsonl"), "a", buffering=1)
            _patch_rest(self)
            if os.environ.get("ET_STEP_PROBE_SWITCH"):
                sys.setswitchinterval(float(os.environ["ET_STEP_PROBE_SWITCH"]))
        self.main = threading.get_native_id()
        if self.pin or self.idle:
            self._place()
        self.step, self.active = step, True
        self.phases: dict[str, float] = {}
        self.t0 = self.last = time.monotonic()
        self.cpu0 = time.thread_time()
        self.ru0 = resource.getrusage(resource.RUSAGE_THREAD)
        self.rp0 = resource.getrusage(resource.RUSAGE_SELF)
        self.others0 = _other_threads_cpu(self.main)

    def _place(self) -> None:
        if self.pin and self.main not in self.placed:
            os.sched_setaffinity(self.main, {0})
        for tid in map(int, os.listdir("/proc/self/task")):
            if tid == self.main or tid in self.placed:
                continue
            try:
                if self.pin:
                    os.sched_setaffinity(tid, {1})
                if self.idle:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                pass
        self.placed = set(map(int, os.listdir("/proc/self/task")))

    def mark(self, name: str) -> None:
        if not self.active or threading.get_native_id() != self.main:
            return
        now = time.monotonic()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now

    def end(self, saved_after: bool = False) -> None:
        if not self.active:
            return
        self.mark("tail")
        self.active = False
        now = time.monotonic()
        ru, rp = resource.getrusage(resource.RUSAGE_THREAD), resource.getrusage(resource.RUSAGE_SELF)
        rec = {
            "step": self.step,
            "start": self.t0,
            "wall": now - self.t0,
            "gap_before": None if self.last_end is None else self.t0 - self.last_end,
            "save_call_before": self.save_seconds,
            "overlapped": self.saved_pending,
            "phases": {k: round(v, 6) for k, v in self.phases.items()},
            "thread_cpu": time.thread_time() - self.cpu0,
            "minflt": ru.ru_minflt - self.ru0.ru_minflt,
            "majflt": ru.ru_majflt - self.ru0.ru_majflt,
            "nvcsw": ru.ru_nvcsw - self.ru0.ru_nvcsw,
            "nivcsw": ru.ru_nivcsw - self.ru0.ru_nivcsw,
            "proc_minflt": rp.ru_minflt - self.rp0.ru_minflt,
            "others_cpu": _other_threads_cpu(self.main) - self.others0,
        }
        self.saved_pending = False
        self.save_seconds = 0.0
        self.out.write(json.dumps(rec) + "\n")
        self.last_end = time.monotonic()


def _wrap(owner, name: str, before=None, after=None) -> None:
    fn = getattr(owner, name)

    def wrapped(*a, **k):
        if before:
            before()
        try:
            return fn(*a, **k)
        finally:
            if after:
                after()

    setattr(owner, name, wrapped)


def _patch(probe: _Probe, step_mod) -> None:
    sc = step_mod.StepContext
    enter, emit = sc.__enter__, sc._emit  # noqa: SLF001 - the probe wraps the step's tail

    def _enter(self):
        probe.start(self.step)
        return enter(self)

    def _emit(self):
        probe.mark("tail")
        emit(self)
        probe.end()

    sc.__enter__, sc._emit = _enter, _emit  # noqa: SLF001 - the probe wraps the step's tail


def _patch_rest(probe: _Probe) -> None:
    import torch

    if os.environ.get("ET_STEP_PROBE_DCP_STAGER") == "1":
        from torch.distributed.checkpoint.staging import DefaultStager

        from elastic_trainer.checkpoint import staging

        staging.KeptStager = DefaultStager  # savers imports it at the first save
    if os.environ.get("ET_STEP_PROBE_SYNC_STAGING") == "1":
        from elastic_trainer.checkpoint import savers

        options = savers.staging_options

        def sync_options(**k):
            o = options(**k)
            o.use_async_staging = False
            return o

        savers.staging_options = sync_options

    from elastic_trainer.checkpoint.manager import CheckpointManager
    from elastic_trainer.runtime.step import StepContext as sc

    _wrap(sc, "agree", after=lambda: probe.mark("agree"))
    _wrap(sc, "check", before=lambda: probe.mark("to_check"), after=lambda: probe.mark("check_allreduce"))
    _wrap(torch.Tensor, "backward", before=lambda: probe.mark("forward"), after=lambda: probe.mark("backward"))
    _wrap(torch.nn.utils, "clip_grad_norm_", before=lambda: probe.mark("to_clip"), after=lambda: probe.mark("clip"))
    _wrap(
        CheckpointManager,
        "wait_for_staging",
        before=lambda: probe.mark("check_allreduce"),
        after=lambda: probe.mark("wait_staging"),
    )
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda *a: probe.mark("to_optim"))
    register_optimizer_step_post_hook(lambda *a: probe.mark("optimizer"))
    save = CheckpointManager.save

    profile = os.environ.get("ET_STEP_PROBE_PROFILE") == "1"
    if profile:
        import cProfile

        prof = cProfile.Profile()

    def _save(self, *a, **k):
        t = time.monotonic()
        try:
            if profile and probe.step > 11:
                prof.enable()
                try:
                    return save(self, *a, **k)
                finally:
                    prof.disable()
                    prof.dump_stats(os.path.join(probe.dir, f"{os.getpid()}.save.pstats"))
            return save(self, *a, **k)
        finally:
            probe.saved_pending = True
            probe.save_seconds = time.monotonic() - t

    CheckpointManager.save = _save


class _Finder(importlib.abc.MetaPathFinder):
    """Patch once the worker has imported the step module (not in the supervisor)."""

    def __init__(self, probe_dir: str):
        self.dir = probe_dir
        self.done = False

    def find_spec(self, fullname, path, target=None):
        if fullname != "elastic_trainer.runtime.step" or self.done:
            return None
        self.done = True
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader
        exec_module = loader.exec_module
        probe_dir = self.dir

        def run(module):
            exec_module(module)
            _patch(_Probe(probe_dir), module)

        loader.exec_module = run
        return spec


def install() -> None:
    d = os.environ.get("ET_STEP_PROBE")
    if d:
        sys.meta_path.insert(0, _Finder(d))
