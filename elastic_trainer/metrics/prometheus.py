"""The Prometheus exporter: the only module that imports ``prometheus_client``.

One endpoint per node, served by the supervisor, which outlives worker restarts. Every process
on the node (the supervisor and each worker) writes its metrics to its own memory-mapped files
in a per-supervisor directory (prometheus_client's multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``);
the supervisor's HTTP server aggregates them on each scrape as the catalogue says
(:mod:`elastic_trainer.metrics.catalog`): counters and histograms summed over every process that
ever ran, so they survive restarts; gauges per their multiprocess mode.

* :func:`start_supervisor_exporter` — supervisor, before any worker starts: makes a fresh
  directory, exports ``PROMETHEUS_MULTIPROC_DIR`` (workers inherit it), serves
  ``metrics.host:metrics.port``. Returns a :class:`SupervisorExporter` (``.sink``, ``.stop()``).
* :func:`make_worker_sink` — worker: a :class:`PrometheusSink` writing to that directory.

Metrics are a side channel: an unknown name or a wrong type is logged once and dropped, and an
exporter that cannot bind its port logs an error and lets training run without metrics.

The endpoint authenticates every request: it answers only a request whose ``Authorization``
header is ``Bearer <token>``, the token being ``ELASTIC_TRAINER_METRICS_TOKEN`` (the same on every
node of a job: a Kubernetes Secret, say, which the scraper sends too), else a random one made at
start and written, readable by its owner alone, to ``metrics.token`` in the supervisor's runtime
directory (:func:`metrics_token`). Anything else gets 401 and no metrics.
"""

from __future__ import annotations

import glob
import hmac
import logging
import os
import secrets
import shutil
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
from prometheus_client import values
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from .. import contract
from ..config import Config
from . import catalog
from .catalog import COUNTER, GAUGE, HISTOGRAM, Metric
from .sink import MetricsSink, NullSink

logger = logging.getLogger(__name__)


def _use_multiprocess_values() -> None:
    """prometheus_client picks its value storage when it is first imported; if that happened
    before ``PROMETHEUS_MULTIPROC_DIR`` was set, switch to the multiprocess storage now (it must
    be in place before the first metric object is built)."""
    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.MultiProcessValue()


class PrometheusSink:
    """A :class:`MetricsSink` over prometheus_client multiprocess metrics.

    Records only the catalogue metrics whose scope is in ``scopes`` (other calls are dropped
    silently: e.g. job-wide metrics on ranks other than 0); fills the ``rank`` label itself.
    Thread-safe (the checkpoint commit thread records from the background)."""

    def __init__(
        self, scopes: frozenset[str], rank: int | None = None, metrics: dict[str, Metric] | None = None, run: str = ""
    ):
        self._scopes = scopes
        self._labels = {"rank": str(rank)} if rank is not None else {}
        self._run = run
        self._catalog = catalog.METRICS if metrics is None else metrics
        self._children: dict[str | tuple[str, tuple[tuple[str, str], ...]], object] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def _child(self, name: str, kind: str, labels: dict[str, str] | None = None):
        key = (name, tuple(sorted(labels.items()))) if labels else name
        child = self._children.get(key)
        if child is not None:
            return child
        spec = self._catalog.get(name)
        if spec is None or spec.type != kind:
            if name not in self._warned:
                self._warned.add(name)
                why = "not in the metrics catalogue" if spec is None else f"a {spec.type}, recorded as a {kind}"
                logger.warning("metric %s dropped: %s", name, why)
            return None
        if spec.scope not in self._scopes:
            return None
        values = {**self._labels, **(labels or {}), catalog.RUN_LABEL: self._run}
        missing = [k for k in spec.labels if k not in values]
        if missing:
            if name not in self._warned:
                self._warned.add(name)
                logger.warning("metric %s dropped: labels %s not given", name, missing)
            return None
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = _build(spec).labels(**{k: str(values[k]) for k in (catalog.RUN_LABEL, *spec.labels)})
                self._children[key] = child
        return child

    def gauge(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        m = self._child(name, GAUGE, labels)
        if m is not None:
            m.set(float(value))

    def counter(self, name: str, amount: float = 1.0) -> None:
        m = self._child(name, COUNTER)
        if m is not None and amount > 0:
            m.inc(float(amount))

    def histogram(self, name: str, value: float) -> None:
        m = self._child(name, HISTOGRAM)
        if m is not None:
            m.observe(float(value))

    def touch(self) -> None:
        """Create every in-scope counter and histogram at zero, so that their series exist
        (``increase()``/alerts see 0, not "no data") before the first event."""
        for spec in self._catalog.values():
            if (
                spec.scope in self._scopes
                and spec.type in (COUNTER, HISTOGRAM)
                and set(spec.labels) <= set(self._labels)
            ):
                self._child(spec.name, spec.type)


def _build(spec: Metric):
    kw: dict[str, Any] = {"registry": None}
    labels = (catalog.RUN_LABEL, *spec.labels)
    if spec.type == GAUGE:
        # a gauge's mode is one of catalog.GAUGE_MODES (catalog.problems)
        return prometheus_client.Gauge(spec.name, spec.help, labels, multiprocess_mode=cast(Any, spec.mode), **kw)
    if spec.type == COUNTER:
        return prometheus_client.Counter(spec.name, spec.help, labels, **kw)
    # a histogram has buckets (catalog.problems)
    return prometheus_client.Histogram(spec.name, spec.help, labels, buckets=cast(Any, spec.buckets), **kw)


def make_worker_sink(cfg: Config, rank: int) -> MetricsSink:
    """A worker's sink. Needs ``PROMETHEUS_MULTIPROC_DIR`` from the supervisor; without it
    (worker started outside ``elastic-trainer launch``) metrics are disabled with a warning."""
    path = os.environ.get(contract.METRICS_DIR_ENV)
    if not path or not os.path.isdir(path):
        logger.warning("%s is not set to a directory: metrics disabled in this worker", contract.METRICS_DIR_ENV)
        return NullSink()
    _use_multiprocess_values()
    scopes = frozenset({"global", "rank"} if rank == 0 else {"rank"})
    sink = PrometheusSink(scopes, rank=rank, run=cfg.run.name)
    sink.touch()
    return sink


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_exited_processes(path: str) -> list[int]:
    """Drop the ``live*`` gauge files of processes that have exited (their counters and
    histograms stay). Returns the pids reaped."""
    reaped = []
    for f in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        try:
            pid = int(os.path.basename(f)[: -len(".db")].rsplit("_", 1)[1])
        except ValueError:
            continue
        if pid != os.getpid() and pid not in reaped and not _pid_alive(pid):
            mark_process_dead(pid, path)
            reaped.append(pid)
    return reaped


class NodeCollector:
    """Aggregates every process's files in ``path`` on each scrape, after dropping the live
    gauges of processes that exited since the last one."""

    def __init__(self, path: str):
        self.path = path
        self._inner = MultiProcessCollector(None, path=path)
        self._lock = threading.Lock()
        self.before_collect: list = []

    def collect(self):
        with self._lock:
            for hook in self.before_collect:
                try:
                    hook()
                except Exception:  # a side channel never breaks the scrape (logged with its traceback)
                    logger.exception("metrics hook %r failed", hook)
            reap_exited_processes(self.path)
            return list(self._inner.collect())


class _Authenticated:
    """WSGI: ``app`` for a request that carries ``Authorization: Bearer <token>``, else 401."""

    def __init__(self, app, token: str):
        self.app = app
        self._want = f"Bearer {token}".encode()

    def __call__(self, request: dict, start_response):  # WSGI's environ: the request's CGI variables
        got = request.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(got, self._want):
            return self.app(request, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"this endpoint needs the job's metrics token: Authorization: Bearer <token>\n"]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


IDLE_SECONDS = 10.0  # a connection that sends no full request within this is closed (Prometheus sends at once)


class _QuietHandler(WSGIRequestHandler):
    # Each connection holds a thread of its own: without a timeout, connections that never send a
    # request (from anywhere that reaches the port) would hold their threads forever.
    timeout = IDLE_SECONDS

    def log_message(self, format, *args):
        pass  # a scrape every few seconds is not news


class SupervisorExporter:
    """The node's HTTP endpoint plus the supervisor's own sink. ``stop()`` is idempotent."""

    def __init__(self, path: str, sink: MetricsSink, registry, collector: NodeCollector | None = None):
        self.path = path
        self.sink = sink
        self.registry = registry
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._collector = collector

    def serve(self, host: str, port: int, token: str) -> None:
        """Serve the node's aggregate on ``host:port`` to requests that carry ``token`` (see the
        module's docstring). A port that cannot be bound is logged as an error; training
        continues without metrics."""
        app = _Authenticated(prometheus_client.make_wsgi_app(self.registry), token)
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            server = type("_Server", (_Server,), {"address_family": family})
            self._httpd = make_server(host, port, app, server_class=server, handler_class=_QuietHandler)
        except OSError as e:
            logger.error("metrics endpoint %s:%d not started (%s); training continues without it", host, port, e)
            return
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="et-metrics", daemon=True)
        self._thread.start()
        logger.info("metrics: http://%s:%d/metrics (files in %s)", host, port, self.path)

    def before_collect(self, hook) -> None:
        """Run ``hook()`` at each scrape, before the files are aggregated (e.g. to set gauges
        computed at scrape time, such as the goodput ledger's)."""
        if self._collector is not None:
            self._collector.before_collect.append(hook)

    @property
    def address(self) -> tuple[str, int] | None:
        # after bind: getsockname()'s (str host, port); typeshed also allows the bytes a bind takes
        return None if self._httpd is None else cast(tuple[str, int], self._httpd.server_address[:2])

    def exposition(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _version() -> str:
    from .. import __version__

    return __version__


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:  # build info is best effort: a torch without package metadata
        return "unknown"


def multiproc_dir(cfg: Config) -> str:
    """This supervisor's metrics directory: ``prometheus`` in its runtime directory."""
    return os.path.abspath(
        os.path.join(contract.runtime_dir(cfg.run.dir, socket.gethostname(), os.getpid()), "prometheus")
    )


def metrics_token(cfg: Config) -> str:
    """The token every request to this node's endpoint must carry: ``ELASTIC_TRAINER_METRICS_TOKEN``
    (surrounding whitespace dropped, as a Secret mounted from a file ends in a newline), else a
    random one written to ``metrics.token`` in the supervisor's runtime directory, readable by its
    owner alone; where it is is logged, never the token."""
    token = os.environ.get(contract.METRICS_TOKEN_ENV, "").strip()
    if token:
        return token
    token = secrets.token_urlsafe(32)
    path = os.path.join(os.path.dirname(multiproc_dir(cfg)), contract.METRICS_TOKEN_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # a file left from before keeps its mode through O_CREAT
        f.write(token + "\n")
    logger.info("metrics: %s is not set; this node's endpoint takes the token in %s", contract.METRICS_TOKEN_ENV, path)
    return token


def start_supervisor_exporter(cfg: Config, *, serve: bool = True) -> SupervisorExporter:
    """Make a fresh metrics directory, export it to future workers through the environment,
    and serve the node's aggregate on ``metrics.host:metrics.port``. Call before any worker
    starts. ``serve=False`` builds everything but the HTTP server (tests)."""
    path = multiproc_dir(cfg)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    os.environ[contract.METRICS_DIR_ENV] = path
    _use_multiprocess_values()
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    collector = NodeCollector(path)
    registry.register(collector)
    sink = PrometheusSink(frozenset({"supervisor"}), run=cfg.run.name)
    sink.touch()
    sink.gauge("elastic_trainer_build_info", 1, {"version": _version(), "torch_version": _torch_version()})
    exporter = SupervisorExporter(path, sink, registry, collector=collector)
    if serve:
        exporter.serve(cfg.metrics.host, cfg.metrics.port, metrics_token(cfg))
    return exporter
