"""Warm worker starts (elastic.warm_start): the zygote protocol with a real forked child, and the
private torch seam it uses (fails loudly when torch moves it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastic_trainer.errors import ConfigError
from elastic_trainer.events import EventLog, read_events
from elastic_trainer.supervisor import warm
from elastic_trainer.supervisor.journal import Journal
from elastic_trainer.supervisor.options import WORKER_MODULE
from elastic_trainer.worker import zygote as zygote_process

CHILD = """
import os, sys, time
ids = ("pid", os.getpid(), "ppid", os.getppid(), "sid", os.getsid(0))
line = " ".join(map(str, ("argv", sys.argv[1:], "env", os.environ.get("WARM_TEST"), *ids)))
os.write(1, (line + "\\n").encode())  # one write: the two children share one output file
print("to stderr", file=sys.stderr)
if "sleep" in sys.argv:
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


pytestmark = pytest.mark.timing  # a wall-clock bound: run alone, not beside other tests


@pytest.mark.parametrize(
    "cmd, args, preload",
    [
        (sys.executable, ["-u", "-m", WORKER_MODULE], ()),  # launch's trainer: the zygote's own list
        (sys.executable, ["-m", WORKER_MODULE, "--x"], ()),
        (sys.executable, ["-u", "-m", "other.module"], ("@script",)),  # run -m MODULE
        # run SCRIPT: unreadable -> no imports of its own
        (sys.executable, ["-u", "missing_train.py", "--steps", "3"], ("@script",)),
        ("/usr/bin/env", ["-u", "-m", WORKER_MODULE], None),  # --no-python: cold
        (sys.executable, ["-u", "-c", "pass"], None),
        (lambda: None, [], None),  # --run-path
    ],
)
def test_what_the_zygote_preloads_for_each_entry_point(cmd, args, preload):
    assert warm.preload_for(cmd, args, WORKER_MODULE) == preload


def test_a_script_preloads_its_installed_imports_and_the_preload_list_but_not_its_own_modules(tmp_path):
    (tmp_path / "mymodel.py").write_text("import os\nRANK = os.environ['RANK']\n")
    (tmp_path / "mypkg").mkdir()
    script = tmp_path / "train.py"
    script.write_text(
        "from __future__ import annotations\nimport argparse, sys\n"
        "import torch.nn.functional as F\nfrom torch import nn\n"
        "import mymodel\nfrom mypkg.sub import x\nfrom . import rel\ndef f():\n    import numpy\n"
    )
    got = warm.preload_for(sys.executable, ["-u", str(script)], WORKER_MODULE, ("transformers", "torch"))
    assert got == ("@script", "argparse", "sys", "torch.nn.functional", "torch:nn", "transformers", "torch")
    assert warm.preload_for(sys.executable, ["-u", "-m", WORKER_MODULE], WORKER_MODULE, ("x",)) == ("@script", "x")
    names = ("transformers:AutoModelForCausalLM,Trainer",)
    assert warm.preload_for(sys.executable, ["-u", "-m", "m"], WORKER_MODULE, names) == ("@script", *names)
    for bad in ("my-mod", "transformers:", "transformers:Auto Model", ":x"):
        with pytest.raises(ConfigError, match="--preload.*" + re.escape(repr(bad))):
            warm.preload_for(sys.executable, ["-u", str(script)], WORKER_MODULE, (bad,))


def test_the_zygote_takes_the_names_a_script_imports_from_a_lazily_loading_package(tmp_path, monkeypatch):
    """``from pkg import Heavy`` of a package that loads ``Heavy`` on first access (as transformers
    does): the zygote loads it, so a restarted worker does not; a name that is neither an
    attribute nor a submodule is reported missing, and the rest still load."""
    pkg = tmp_path / "site" / "lazypkg_et"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "def __getattr__(name):\n"
        "    if name == 'Heavy':\n"
        "        from .heavy import Heavy\n"
        "        return Heavy\n"
        "    raise AttributeError(name)\n"
    )
    (pkg / "heavy.py").write_text("class Heavy:\n    pass\n")
    (pkg / "sub.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    script = tmp_path / "train.py"
    script.write_text("from lazypkg_et import Heavy, sub, nope\n")
    (entry,) = warm.script_imports(str(script))
    assert entry == "lazypkg_et:Heavy,sub,nope"
    for m in [m for m in sys.modules if m.startswith("lazypkg_et")]:
        monkeypatch.delitem(sys.modules, m)
    assert zygote_process.preload([entry, "no_such_module_et:x"]) == ["lazypkg_et.nope", "no_such_module_et"]
    assert {"lazypkg_et.heavy", "lazypkg_et.sub"} <= set(sys.modules)


class _FakeZygote:
    def __init__(self, fail: bool = False):
        self.fail, self.calls = fail, []

    def spawn(self, argv, env, stdout=None, stderr=None):
        self.calls.append((argv, env, stdout, stderr))
        if self.fail:
            raise warm.ZygoteError("zygote gone")
        return warm.ZygoteProcess(self, 424242, argv)


def _context(tmp_path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL)
    return SubprocessContext("t", sys.executable, {0: ("-c", "pass")}, {0: {"RANK": "0"}}, specs)


def test_torch_seam_is_where_warm_start_expects_it(tmp_path):
    """warm.warm_handlers swaps torch's api.get_subprocess_handler, which SubprocessContext calls
    to build each worker, for a SubprocessHandler whose _popen asks the zygote: the context then
    holds the zygote's process, with torch's env (error file) and log redirects. Fails loudly
    when torch moves this seam."""
    from torch.distributed.elastic.multiprocessing import api

    original = api.get_subprocess_handler
    fake = _FakeZygote()
    ctx = _context(tmp_path)
    with warm.warm_handlers(fake):
        assert api.get_subprocess_handler is not original
        ctx._start()  # what PContext.start() runs after installing its signal handlers
    assert api.get_subprocess_handler is original
    assert ctx.pids() == {0: 424242}
    ((argv, env, stdout, stderr),) = fake.calls
    assert argv == [sys.executable, "-c", "pass"] and env["RANK"] == "0" and "TORCHELASTIC_ERROR_FILE" in env
    assert env["PATH"] == os.environ["PATH"]  # torch's handler: the agent's environment plus the worker's
    assert stdout is not None and stderr is not None and stdout.name.endswith("stdout.log")


def test_a_zygote_failure_falls_back_to_a_cold_popen(tmp_path):
    fake, reasons = _FakeZygote(fail=True), []
    ctx = _context(tmp_path)
    with warm.warm_handlers(fake, on_fallback=reasons.append):
        ctx._start()
    proc = ctx.subprocess_handlers[0].proc
    assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0
    assert reasons == ["zygote gone"]


class _ServingZygote(_FakeZygote):
    """What :class:`warm.WarmStart` reads of a zygote besides ``spawn``."""

    pid, forked, info, preload = 4242, True, {"threads": 1}, ("x",)

    def __init__(self, fail: bool = False, alive: bool = True):
        super().__init__(fail)
        self.alive, self.closed, self.started = alive, 0, 0

    def close(self):
        self.closed += 1

    def start(self, fork=None):
        self.started += 1
        return self


def _started(journal: Journal, name: str) -> list[dict]:
    return [e for e in read_events(journal.events.path) if e["event"] == name]


@pytest.fixture
def journal(tmp_path):
    return Journal(EventLog(str(tmp_path / "events.jsonl")), node="n0")


def test_warm_start_without_a_zygote_starts_workers_as_torch_does(journal):
    ws = warm.WarmStart(None, journal)
    assert ws.start(lambda: {0: 11, 1: 10}) == {0: 11, 1: 10}
    (e,) = _started(journal, "workers_started")
    assert (e["warm"], e["pids"], e["zygote_pid"], e["zygote_forked"], e["node"]) == (False, [10, 11], None, None, "n0")
    ws.close()


def test_warm_start_forks_the_group_from_the_zygote(journal, tmp_path):
    fake, ctx = _ServingZygote(), _context(tmp_path)
    ws = warm.WarmStart(fake, journal)

    def start_workers():
        ctx._start()
        return ctx.pids()

    assert ws.start(start_workers) == {0: 424242} and len(fake.calls) == 1
    (e,) = _started(journal, "workers_started")
    assert (e["warm"], e["pids"], e["zygote_pid"], e["zygote_forked"], e["zygote_threads"]) == (
        True,
        [424242],
        4242,
        True,
        1,
    )
    assert ws.zygote is fake and not _started(journal, "warm_start_unavailable")
    ws.close()
    assert fake.closed == 1


@pytest.mark.parametrize("alive, restarts, replaced", [(True, 1, False), (False, 1, True), (False, 0, False)])
def test_a_zygote_that_cannot_start_a_worker_is_replaced_once_if_dead_else_dropped(
    journal, tmp_path, monkeypatch, alive, restarts, replaced
):
    monkeypatch.setattr(warm, "Zygote", lambda preload: _ServingZygote() if preload == ("x",) else None)
    fake, ctx = _ServingZygote(fail=True, alive=alive), _context(tmp_path)
    ws = warm.WarmStart(fake, journal, zygote_restarts=restarts)

    def start_workers():
        ctx._start()
        return ctx.pids()

    pids = ws.start(start_workers)
    assert ctx.subprocess_handlers[0].proc.wait(60) == 0  # started cold
    assert fake.closed == 1 and list(pids.values()) == [ctx.subprocess_handlers[0].proc.pid]
    assert (ws.zygote is not None) is replaced and (not replaced or ws.zygote.started == 1)
    ((started,), (unavailable,)) = _started(journal, "workers_started"), _started(journal, "warm_start_unavailable")
    assert started["warm"] is False and started["zygote_pid"] == 4242
    assert (unavailable["reason"], unavailable["zygote_restarted"]) == ("zygote gone", replaced)


@pytest.fixture(params=["spawned", "forked"])
def zygote(request, tmp_path, monkeypatch):
    """The zygote as its own interpreter, and forked from this process (as the CLI does once it
    imported torch): the same protocol, the same children."""
    (tmp_path / "warm_child.py").write_text(CHILD)
    monkeypatch.chdir(tmp_path)  # 'python -m' puts the working directory first on sys.path
    z = warm.Zygote(preload=("numpy",), ready_timeout=120)
    if request.param == "forked":
        # Earlier tests may leave idle daemon threads here (tqdm's monitor, fsspec's loop) that the
        # child never touches; the check that refuses to fork a process with threads is tested
        # on its own (test_a_process_running_a_thread_starts_the_zygote_as_its_own_interpreter).
        monkeypatch.setattr(zygote_process, "may_fork", lambda: True)
        z.start(fork=zygote_process.fork)
        assert z.forked
    else:
        z.start()
        assert isinstance(z.proc, subprocess.Popen) and not z.forked
    yield z
    z.close()


def test_zygote_forks_fresh_single_threaded_children_with_exactly_the_given_env(zygote, tmp_path):
    info = zygote.wait_ready()
    assert info["threads"] == 1  # numpy's OpenBLAS pool is stopped before any fork
    assert os.getsid(zygote.pid) == zygote.pid  # a session of its own: a terminal's Ctrl-C goes to the supervisor
    out, err = open(tmp_path / "out", "w"), open(tmp_path / "err", "w")
    env = {"PATH": os.environ["PATH"], "WARM_TEST": "yes"}
    procs = [
        zygote.spawn([sys.executable, "-u", "-m", "warm_child", "3"], env, stdout=out, stderr=err) for _ in range(2)
    ]
    assert [p.wait(30) for p in procs] == [3, 3]
    out.close(), err.close()
    lines = (tmp_path / "out").read_text().splitlines()
    assert len(lines) == 2 and "to stderr" in (tmp_path / "err").read_text()
    pids = set()
    for line in lines:
        f = line.split()
        assert f[1:3] == ["['3']", "env"] and f[3] == "yes"
        pid, ppid, sid = int(f[5]), int(f[7]), int(f[9])
        assert ppid == zygote.pid and sid == pid  # a child of the zygote, in its own session (killpg works)
        pids.add(pid)
    assert pids == {p.pid for p in procs} and zygote.pid not in pids


def test_signals_and_exit_codes_reach_the_agent_like_popen(zygote):
    zygote.wait_ready()
    env = {"PATH": os.environ["PATH"]}
    p = zygote.spawn([sys.executable, "-u", "-m", "warm_child", "0", "sleep"], env)
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    os.killpg(p.pid, signal.SIGKILL)  # what torch's SubprocessHandler.close does
    assert p.wait(30) == -signal.SIGKILL and p.poll() == -signal.SIGKILL
    ok = zygote.spawn([sys.executable, "-u", "-m", "warm_child", "0"], env)
    assert ok.wait(30) == 0
    with pytest.raises(warm.ZygoteError, match="python -u -m MODULE"):
        zygote.spawn([sys.executable, "-c", "pass"], env)


def test_the_zygote_runs_a_script_as_python_would(zygote, tmp_path):
    """'run SCRIPT.py': the child runs the file as __main__, its directory first on sys.path, its
    path in argv[0], and its atexit handlers run when it exits, as with 'python SCRIPT.py'."""
    zygote.wait_ready()
    sub = tmp_path / "scripts"
    sub.mkdir()
    (sub / "helper.py").write_text("VALUE = 'helper next to the script'\n")
    (sub / "train.py").write_text(
        "import atexit, os, sys\nimport helper\nif __name__ == '__main__':\n"
        "    atexit.register(lambda: os.write(1, b' atexit ran'))\n"
        "    os.write(1, repr((sys.argv, sys.path[0], helper.VALUE)).encode())\n    sys.exit(4)\n"
    )
    with open(tmp_path / "out", "w") as out:
        p = zygote.spawn(
            [sys.executable, "-u", str(sub / "train.py"), "--steps", "3"], {"PATH": os.environ["PATH"]}, stdout=out
        )
        assert p.wait(30) == 4
    assert (tmp_path / "out").read_text() == repr(
        ([str(sub / "train.py"), "--steps", "3"], str(sub), "helper next to the script")
    ) + " atexit ran"


def test_a_zygote_whose_imports_initialised_cuda_or_a_process_group_is_refused():
    for what in ("cuda", "process_group"):
        z = warm.Zygote()
        z.info = {"ready": 1, "threads": 1, what: True}
        with pytest.raises(warm.ZygoteError, match=what.replace("_", " ")):
            z.wait_ready()


def test_the_zygote_ignores_the_signals_the_supervisor_forwards_but_its_workers_do_not(zygote, tmp_path):
    """SLURM signals every process of a job step: the zygote must survive SIGTERM (its death
    would SIGKILL the workers mid-checkpoint), while a worker gets SIGTERM's default action."""
    zygote.wait_ready()
    with open(tmp_path / "out", "w") as out:
        p = zygote.spawn(
            [sys.executable, "-u", "-m", "warm_child", "0", "sleep"], {"PATH": os.environ["PATH"]}, stdout=out
        )
    deadline = time.monotonic() + 30
    while "argv" not in (tmp_path / "out").read_text():  # the module runs: dispositions were restored before
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.02)
    os.kill(zygote.pid, signal.SIGTERM)
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM
    assert zygote.alive and zygote.proc.poll() is None


def test_children_die_with_the_zygote_and_the_zygote_exits_when_the_supervisor_closes(zygote):
    zygote.wait_ready()
    p = zygote.spawn([sys.executable, "-u", "-m", "warm_child", "0", "sleep"], {"PATH": os.environ["PATH"]})
    os.kill(zygote.pid, signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL  # PR_SET_PDEATHSIG
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{p.pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{p.pid}")
    assert not zygote.alive


def test_closing_the_socket_ends_the_zygote(zygote):
    zygote.wait_ready()
    zygote.close()
    assert zygote.proc.returncode == 0


FRESH = """
import logging, os, sys
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
handlers = logging.getLogger("elastic_trainer").handlers
os.write(1, repr((fds, len(handlers), sys.path[0])).encode())
"""


def test_launch_forks_the_zygote_once_it_imported_torch_and_its_workers_start_as_fresh_ones(tmp_path):
    """'launch' imports torch once and forks the zygote from itself (no second interpreter start
    or torch import beside the supervisor's); its workers are what a fresh interpreter would be:
    no descriptor of the supervisor's but 0-2 (3: the listing's own), the CLI's logging set-up
    undone, the working directory first on sys.path. No zygote when the config opts out or
    cannot be read there."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[elastic]\nnproc_per_node = 1\n")
    off = tmp_path / "off.toml"
    off.write_text("[elastic]\nwarm_start = false\n")
    (tmp_path / "fresh_child.py").write_text(FRESH)
    code = f"""
import os, sys
from elastic_trainer import cli, log
from elastic_trainer.supervisor import warm
log.setup_logging()
leak = open({str(tmp_path / "c.toml")!r})  # a descriptor of the supervisor's: not the workers'
z = cli._early_zygote([{str(cfg)!r}, "--nproc-per-node", "1"])
print("forked", isinstance(z.proc, warm.ForkedChild), "torch", "torch" in sys.modules)
with open("out", "w") as out:
    p = z.spawn([sys.executable, "-u", "-m", "fresh_child"], {{"PATH": os.environ["PATH"]}}, stdout=out)
    print("exit", p.wait(60))
print(open("out").read())
z.close()
print("closed", z.proc.returncode)
print("off", cli._early_zygote([{str(off)!r}]), cli._early_zygote([{str(cfg)!r}, "--set", "elastic.warm_start=false"]))
print("unreadable", cli._early_zygote(["--rdzv-id", "x"]), cli._early_zygote([str({str(tmp_path / "missing.toml")!r})]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "forked True torch True",
        "exit 0",
        repr(([0, 1, 2, 3], 0, str(tmp_path))),
        "closed 0",
        "off None None",
        "unreadable None None",
    ]


def test_a_process_running_a_thread_starts_the_zygote_as_its_own_interpreter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        z = warm.Zygote(preload=("numpy",)).start(fork=zygote_process.fork)
    finally:
        stop.set()
        t.join()
    try:
        assert isinstance(z.proc, subprocess.Popen) and z.wait_ready()["threads"] == 1
    finally:
        z.close()


def test_closing_the_handler_of_a_worker_that_already_exited_does_not_raise(zygote, tmp_path):
    """torch stops a group with killpg; a Popen child that exited is a zombie whose group still
    exists, but the zygote reaps its children at once, so the group is gone (ESRCH). Seen in
    CI: a worker exited between the agent's poll and its close, and the supervisor crashed."""
    zygote.wait_ready()
    cls = warm._handler_class(zygote, lambda reason: None)
    h = cls(
        entrypoint=sys.executable,
        args=("-u", "-m", "warm_child", "0"),
        env={"PATH": os.environ["PATH"]},
        stdout=str(tmp_path / "out"),
        stderr=str(tmp_path / "err"),
        local_rank_id=0,
        numa_options=None,
    )
    assert isinstance(h.proc, warm.ZygoteProcess) and h.proc.wait(30) == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(h.proc.pid, signal.SIGTERM)  # what torch's close does first: the group is gone
    h.close()
    h.close(signal.SIGKILL)  # torch's _close escalates with a second close
    assert h._stdout.closed and h._stderr.closed


def test_the_checkpoint_storage_module_is_preloaded_for_every_entry_point():
    from elastic_trainer.storage.fs import backend_modules

    assert backend_modules("s3://bucket/run") == ("s3fs",)
    assert backend_modules("gs://bucket/run") == ("gcsfs",)
    assert backend_modules("/data/ckpt") == backend_modules("file:///data/ckpt") == ()
    s3 = ("s3fs",)
    assert warm.preload_for(sys.executable, ["-u", "-m", WORKER_MODULE], WORKER_MODULE, backend=s3) == (
        "@trainer",
        "s3fs",
    )
    assert warm.preload_for(sys.executable, ["-u", "-m", "m"], WORKER_MODULE, ("x",), s3) == ("@script", "s3fs", "x")
    assert warm.preload_for(sys.executable, ["-u", "-m", WORKER_MODULE], WORKER_MODULE, backend=()) == ()


def test_the_early_zygote_preloads_what_launch_needs_so_it_is_kept(tmp_path, monkeypatch):
    """``launch`` forks its zygote before parsing everything; with ``checkpoint.dir`` on S3 both
    must name the same modules, or the early zygote is closed and a second one started."""
    from elastic_trainer import cli
    from elastic_trainer.config import load_config
    from elastic_trainer.supervisor import launcher

    made = []

    class Fake:
        def __init__(self, preload=()):
            self.preload, self.closed = tuple(preload), False
            made.append(self)

        def start(self, fork=None):
            return self

        def close(self):
            self.closed = True

    monkeypatch.setattr(warm, "Zygote", Fake)
    cfg_file = tmp_path / "job.toml"
    cfg_file.write_text('[checkpoint]\ndir = "s3://bucket/run"\ns3_endpoint_url = "http://127.0.0.1:9"\n')
    early = cli._early_zygote([str(cfg_file)])
    assert early is made[0] and early.preload == ("@trainer", "s3fs")
    cfg = load_config(str(cfg_file), [])
    kept = launcher.start_zygote(cfg, sys.executable, ["-u", "-m", WORKER_MODULE], early=early)
    assert kept is early and not early.closed and len(made) == 1


def test_a_zygote_that_preloads_the_s3_filesystem_stays_single_threaded():
    """s3fs (aiobotocore, aiohttp) starts no thread at import: a zygote can preload it and fork."""
    z = warm.Zygote(preload=("s3fs",), ready_timeout=120).start()
    try:
        info = z.wait_ready()
        assert info["threads"] == 1 and not info.get("missing"), info
    finally:
        z.close()


def _handler(zygote, tmp_path, *args: str):
    cls = warm._handler_class(zygote, lambda reason: None)
    return cls(
        entrypoint=sys.executable,
        args=("-u", "-m", "warm_child", *args),
        env={"PATH": os.environ["PATH"]},
        stdout=str(tmp_path / "out"),
        stderr=str(tmp_path / "err"),
        local_rank_id=0,
        numa_options=None,
    )


def test_a_worker_stopped_the_moment_it_is_forked_stops(zygote, tmp_path):
    """The agent may stop a group right after starting it (its loop failed there): the worker
    has not made its own process group yet (killpg: ESRCH) or still has the zygote's ignored
    dispositions. Each worker must still act on the signal, not train on unsignalled. Seen in the
    namespace cluster: a worker kept training after its supervisor stopped it."""
    zygote.wait_ready()
    for _ in range(20):
        h = _handler(zygote, tmp_path, "0", "sleep")
        h.close(signal.SIGTERM)  # at once, as torch's _close after a failed restart
        assert h.proc.wait(30) == -signal.SIGTERM


def test_closing_the_handler_of_a_worker_without_its_own_group_signals_the_worker(zygote, tmp_path):
    """killpg finds no group (ESRCH) while the worker itself runs: the signal goes to the worker."""
    zygote.wait_ready()
    h = _handler(zygote, tmp_path, "0")
    assert h.proc.wait(30) == 0
    h.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # in this process's group
    try:
        with pytest.raises(ProcessLookupError):
            os.killpg(h.proc.pid, signal.SIGTERM)
        h.close(signal.SIGTERM)
        assert h.proc.wait(30) == -signal.SIGTERM
    finally:
        h.proc.kill()


def test_a_zygote_that_preloads_pyarrow_forks_over_jemallocs_background_thread(tmp_path):
    """pyarrow's jemalloc starts a background thread at import (``import transformers`` does it
    where ``datasets`` is installed). jemalloc's own fork handlers make a fork over it safe, so
    the zygote counts it out and stays warm; a worker forked from it allocates through pyarrow."""
    probe = "import os, pyarrow; from elastic_trainer.worker import zygote; "
    probe += "print(sorted(open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')), "
    probe += "zygote.settle_threads())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("]")[0].count("jemalloc_bg_thd") == 1 and out.stdout.split()[-1] == "1", out.stdout
    z = warm.Zygote(preload=("pyarrow",), ready_timeout=120).start()
    try:
        info = z.wait_ready()
        assert info["threads"] == 1 and not info.get("missing"), info
        script = tmp_path / "child.py"
        script.write_text("import pyarrow as pa\n[pa.array(range(10**5)) for _ in range(20)]\nraise SystemExit(7)\n")
        procs = [z.spawn([sys.executable, "-u", str(script)], {"PATH": os.environ["PATH"]}) for _ in range(4)]
        assert [p.wait(60) for p in procs] == [7, 7, 7, 7]
    finally:
        z.close()


def test_a_forked_script_that_raises_ends_as_the_interpreter_records_an_uncaught_exception(zygote, tmp_path):
    """``sys.last_value`` is set before the script's atexit handlers run, as ``python SCRIPT`` sets
    it: the Accelerate and Transformers front ends' exit handler tells an exception's end by it and
    starts no final save or collective (else a raising rank's peers wait for it in one)."""
    zygote.wait_ready()
    script = tmp_path / "raises.py"
    script.write_text(
        "import atexit, sys\n"
        "atexit.register(lambda: print('at exit:', repr(getattr(sys, 'last_value', None)), flush=True))\n"
        "raise RuntimeError('boom')\n"
    )
    out = open(tmp_path / "out", "w")
    p = zygote.spawn([sys.executable, "-u", str(script)], {"PATH": os.environ["PATH"]}, stdout=out, stderr=out)
    assert p.wait(30) == 1
    out.close()
    assert "at exit: RuntimeError('boom')" in (tmp_path / "out").read_text()
