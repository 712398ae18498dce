"""The supervisor–worker contract (elastic_trainer/contract.py) against the code: every event the
code writes (and every field) is catalogued and every catalogued one is written; readers of the
log ask only for catalogued events; environment variable names, shared file names and the zygote
protocol's constants live in the contract module alone; EventLog's checking mode."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
from pathlib import Path

import pytest

from elastic_trainer import contract
from elastic_trainer.events import EventLog

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "elastic_trainer"
SBATCH = REPO / "deploy" / "slurm" / "elastic-trainer.sbatch"


def _modules() -> dict[str, ast.Module]:
    return {
        f.relative_to(PACKAGE).as_posix(): ast.parse(f.read_text())
        for f in sorted(PACKAGE.rglob("*.py"))
        if f.name != "contract.py" or f.parent != PACKAGE
    }


MODULES = _modules()


def _emit_calls() -> list[tuple[str, int, ast.expr, set[str], bool]]:
    """Every ``X.emit(...)`` in the package: (where, line, event expression, keyword names, ``**x`` passed)."""
    out = []
    for where, tree in MODULES.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "emit" and n.args:
                out.append(
                    (
                        where,
                        n.lineno,
                        n.args[0],
                        {k.arg for k in n.keywords if k.arg},
                        any(k.arg is None for k in n.keywords),
                    )
                )
    return out


def _sbatch_events() -> dict[str, set[str]]:
    """The SLURM batch script's events: ``event NAME ", \\"field\\": ..."`` lines (its ``event``
    function adds ``job_id`` and ``restart_count``)."""
    out: dict[str, set[str]] = {}
    for name, extra in re.findall(r'^event (\w+) "(.*)"$', SBATCH.read_text(), re.M):
        out.setdefault(name, {"job_id", "restart_count"}).update(re.findall(r'\\"(\w+)\\": ', extra))
    return out


# --------------------------------------------------------------------------------------- events


def test_the_event_catalogue_follows_its_conventions():
    assert contract.problems() == []


@pytest.mark.parametrize(
    "bad, problem",
    [
        (contract.Event("Step", "rank 0", "m", ()), "snake_case"),
        (contract.Event("x", "rank 7", "m", ()), "writer"),
        (contract.Event("x", "rank 0", "", ()), "one line"),
        (contract.Event("x", "rank 0", "two\nlines", ()), "one line"),
        (contract.Event("x", "rank 0", "m", (contract.Field("a"), contract.Field("a"))), "twice"),
        (contract.Event("x", "rank 0", "m", (contract.Field("time"),)), "of its own"),
        (contract.Event("x", "rank 0", "m", (contract.Field("a", "x | y"),)), "breaks the table"),
    ],
)
def test_catalogue_problems_are_caught(bad, problem):
    found = contract.problems((bad,))
    assert any(problem in p for p in found), found
    assert any("defined twice" in p for p in contract.problems((contract.EVENTS[0], contract.EVENTS[0])))


def test_every_emit_call_names_its_event_literally():
    """The scan below (and anyone grepping for an event) sees every event only if its name is written at the call."""
    calls = _emit_calls()
    assert len(calls) > 40, "the source scan found too few emit calls"
    dynamic = [
        f"{w}:{line}"
        for w, line, name, _, _ in calls
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str))
    ]
    assert not dynamic, f"emit(...) with a computed event name: {dynamic}"


def test_every_event_and_field_the_code_writes_is_catalogued():
    problems = []
    for where, line, name, fields, starred in _emit_calls():
        problems += [f"{where}:{line}: {p}" for p in contract.event_problems(name.value, fields, partial=starred)]
    for name, fields in _sbatch_events().items():
        problems += [f"{SBATCH.name}: {p}" for p in contract.event_problems(name, fields)]
    assert not problems, "\n".join(problems)


def test_every_catalogued_event_and_field_is_written_somewhere():
    written: dict[str, set[str]] = {}
    open_ended = (
        set()
    )  # events some call completes with **fields: their other fields are checked at run time (EventLog.check)
    for _, _, name, fields, starred in _emit_calls():
        written.setdefault(name.value, set()).update(fields)
        if starred:
            open_ended.add(name.value)
    for name, fields in _sbatch_events().items():
        written.setdefault(name, set()).update(fields)
    assert sorted(set(contract.EVENT_NAMES) - set(written)) == [], "catalogued events nothing writes"
    unused = {
        e.name: sorted(e.names - written[e.name])
        for e in contract.EVENTS
        if e.name not in open_ended and e.names - written[e.name]
    }
    assert not unused, f"catalogued fields nothing writes: {unused}"


def _names_in(node: ast.expr, module: ast.Module) -> list[str]:
    """String constants of ``node``: a constant, a tuple/set/list of them, or a module-level name bound to one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.Set, ast.List)):
        return [s for e in node.elts for s in _names_in(e, module)]
    if isinstance(node, ast.Name):
        for stmt in module.body:
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id for t in stmt.targets):
                return _names_in(stmt.value, module)
    return []


def _is_event_of_a_record(node: ast.expr) -> bool:
    """``e.get("event")``, ``e["event"]`` or a variable ``ev`` holding one."""
    if isinstance(node, ast.Name):
        return node.id == "ev"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return isinstance(node.args[0], ast.Constant) and node.args[0].value == "event"
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "event"


def _read_events() -> dict[str, set[str]]:
    """Event names the package's readers of the log compare records against, by module."""
    out: dict[str, set[str]] = {}
    for where, tree in MODULES.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Compare) and _is_event_of_a_record(n.left):
                for comparator in n.comparators:
                    for name in _names_in(comparator, tree):
                        out.setdefault(name, set()).add(where)
            if isinstance(n, ast.Lambda) and any(
                _is_event_of_a_record(c.left) for c in ast.walk(n.body) if isinstance(c, ast.Compare)
            ):
                # report.py's ``by = lambda name: [e for e in events if e.get("event") == name]``:
                # its callers' arguments
                for call in ast.walk(tree):
                    if (
                        isinstance(call, ast.Call)
                        and isinstance(call.func, ast.Name)
                        and call.func.id == "by"
                        and call.args
                    ):
                        for name in _names_in(call.args[0], tree):
                            out.setdefault(name, set()).add(where)
    return out


def test_every_event_a_reader_of_the_log_asks_for_is_catalogued():
    read = _read_events()
    assert {"goodput.py", "report.py", "checkpoint/cadence.py", "supervisor/history.py"} <= {
        w for ws in read.values() for w in ws
    }, read
    assert {n: sorted(w) for n, w in read.items() if n not in contract.EVENT_NAMES} == {}


def test_checking_mode_refuses_events_and_fields_outside_the_catalogue(tmp_path):
    assert EventLog.check, "tests/conftest.py switches the checking mode on for every in-process test"
    log = EventLog(str(tmp_path / contract.EVENTS_FILE))
    with pytest.raises(ValueError, match="'no_such_event' is not in the catalogue"):
        log.emit("no_such_event", step=1)
    with pytest.raises(ValueError, match="required field 'bytes' missing"):
        log.emit("checkpoint_committed", step=1, name="step-1", seconds=0.1, world_size=2)
    with pytest.raises(ValueError, match="field 'colour' is not in the catalogue"):
        log.emit("fenced", step=1, error="newer epoch", colour="red")
    with pytest.raises(ValueError, match="'time' is reserved"):
        log.emit("fenced", step=1, error="newer epoch", time=0)
    # optional fields may be left out; an extensible event takes a script's own fields
    log.emit("checkpoint_skipped", step=3, reason="older than the head")
    log.emit(
        "step", step=1, loss=2.5, lr=1e-3, grad_norm=0.5, world_size=2, step_time_s=0.1, tokens_per_s=10.0, my_metric=7
    )
    written = [json.loads(line)["event"] for line in (tmp_path / contract.EVENTS_FILE).read_text().splitlines()]
    assert written == ["checkpoint_skipped", "step"], "a refused record must not reach the log"


def test_checking_mode_off_writes_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(EventLog, "check", False)
    log = EventLog(str(tmp_path / contract.EVENTS_FILE))
    log.emit("something_new", anything=1)
    assert json.loads((tmp_path / contract.EVENTS_FILE).read_text())["event"] == "something_new"


def test_a_disabled_log_still_checks():
    """Ranks other than 0 write nothing but make the same calls: the check holds there too."""
    with pytest.raises(ValueError):
        EventLog(None).emit("no_such_event")


# --------------------------------------------------------------------- environment and files


def _env_constants() -> dict[str, str]:
    return {k: v for k, v in vars(contract).items() if k.endswith("_ENV") and isinstance(v, str)}


def test_every_environment_constant_is_catalogued_once():
    names = [v.name for v in contract.ENV_VARS]
    assert len(names) == len(set(names))
    assert sorted(_env_constants().values()) == sorted(names)
    assert all(v.set_by and v.read_by and v.meaning.endswith(".") for v in contract.ENV_VARS)


def _contract_refs() -> set[str]:
    """Names the package takes from the contract module (``contract.X`` or ``from ..contract import X``)."""
    refs = set()
    for tree in MODULES.values():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "contract":
                refs.add(n.attr)
            if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("contract"):
                refs.update(a.name for a in n.names)
    return refs


def test_every_contract_name_is_used_by_the_package():
    """No dead entry: each constant of the contract is read or set somewhere."""
    constants = [
        k
        for k, v in vars(contract).items()
        if k.isupper() and not k.startswith("_") and isinstance(v, (str, int, tuple, dict))
    ]
    docs_only = {
        "ENV_VARS",
        "EVENTS",
        "RECORD_FIELDS",
        "WRITERS",
        "ZYGOTE_MESSAGES",
        "PREEMPT_MARKER_FIELDS",
        "EVENT_NAMES",
    }  # checked here
    own = {  # read by the contract's own functions (e.g. runtime_dir), which the package calls
        n.id
        for f in ast.parse(Path(contract.__file__).read_text()).body
        if isinstance(f, ast.FunctionDef) and f.name in _contract_refs()
        for n in ast.walk(f)
        if isinstance(n, ast.Name)
    }
    unused = sorted(set(constants) - docs_only - _contract_refs() - own)
    assert unused == []


# Variables of the S3 client the storage layer reads for the user (not exchanged by the supervisor and the workers).
STORAGE_ENV = {"AWS_ENDPOINT_URL_S3", "FSSPEC_S3_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION"}
CONTRACT_STRINGS = re.compile(r"^(ELASTIC_TRAINER_\w+|TORCHELASTIC_\w+|TORCH_\w+|PET_\w*|PROMETHEUS_MULTIPROC_DIR)$")


SHARED = set(_env_constants().values()) | {
    contract.EVENTS_FILE,
    contract.PREEMPT_MARKER,
    contract.TIMER_FILE,
    contract.RUNTIME_DIR,
    contract.EVENTS_MIRROR_DIR,
    contract.ZYGOTE_MODULE,
    contract.ZYGOTE_PRELOAD_TRAINER,
    contract.ZYGOTE_PRELOAD_SCRIPT,
    contract.TORCHRUN_ENV_PREFIX,
}


def _spelled_out(tree: ast.Module) -> list[str]:
    """Contract names a module writes by hand: string constants (docstrings aside) and
    environment lookups with a literal key."""
    found = []
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(n) is not None
    }
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            if n.value in SHARED or CONTRACT_STRINGS.match(n.value):
                found.append(f"{n.lineno}: {n.value!r}")
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("get", "setdefault", "pop")
            and n.args
        ):
            if (
                "environ" in ast.unparse(n.func.value)
                and isinstance(n.args[0], ast.Constant)
                and n.args[0].value not in STORAGE_ENV | SHARED
            ):
                found.append(f"{n.lineno}: os.environ lookup of {n.args[0].value!r}")
        if (
            isinstance(n, ast.Subscript)
            and "environ" in ast.unparse(n.value)
            and isinstance(n.slice, ast.Constant)
            and n.slice.value not in SHARED
        ):
            found.append(f"{n.lineno}: os.environ[{n.slice.value!r}]")
    return found


def test_environment_names_and_shared_file_names_are_written_only_in_the_contract():
    found = [f"{where}:{hit}" for where, tree in MODULES.items() for hit in _spelled_out(tree)]
    assert not found, "use the constants of elastic_trainer/contract.py:\n" + "\n".join(found)


def test_the_scan_sees_names_spelled_out():
    """The guard is not vacuous: on a module that names variables and files by hand it finds each."""
    tree = ast.parse(
        '"""Reads ELASTIC_TRAINER_NODE."""\nimport os\n'
        'x = os.environ.get("ELASTIC_TRAINER_NODE")\ny = os.environ["RANK"]\nz = os.environ.get("LOCAL_RANK", "0")\n'
        'p = os.path.join(d, "events.jsonl")\nq = os.environ.get(contract.RANK_ENV)\n'
    )
    assert [h.split(":")[0] for h in _spelled_out(tree)] == ["3", "4", "5", "6"], _spelled_out(tree)


def test_the_preemption_marker_has_the_fields_the_supervisor_reads():
    writer = MODULES["runtime/run.py"]
    dicts = [
        n
        for n in ast.walk(writer)
        if isinstance(n, ast.Dict) and {"exit_code", "committed_step"} <= set(_names_in(ast.Tuple(elts=n.keys), writer))
    ]
    assert len(dicts) == 1, "rank 0's marker is one dict literal"
    assert tuple(k.value for k in dicts[0].keys) == contract.PREEMPT_MARKER_FIELDS
    read = {
        n.args[0].value
        for n in ast.walk(MODULES["supervisor/policy.py"])
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "get"
        and "preempt_marker" in ast.unparse(n.func.value)
    }
    assert read and read <= set(contract.PREEMPT_MARKER_FIELDS)


def test_the_supervisor_forwards_the_signals_the_zygote_ignores():
    from elastic_trainer.supervisor import options

    assert all(isinstance(getattr(signal, name), signal.Signals) for name in contract.FORWARDED_SIGNALS)
    assert options.SIGNALS_TO_HANDLE.split(",") == list(contract.FORWARDED_SIGNALS)


# ------------------------------------------------------------------------------- zygote protocol


def _message_keys(where: str, func: str) -> list[list[str]]:
    """Constant keys of the dict literals passed to ``func(...)`` (or ``func(sock, {...})``) in a module."""
    out = []
    for n in ast.walk(MODULES[where]):
        if isinstance(n, ast.Call) and ast.unparse(n.func) == func:
            for arg in n.args:
                if isinstance(arg, ast.Dict):
                    out.append([k.value for k in arg.keys if isinstance(k, ast.Constant)])
    return out


def _kind(keys: list[str]) -> str | None:
    return next(
        (
            k
            for k, v in contract.ZYGOTE_MESSAGES.items()
            if keys
            and keys[0] == v[0]
            and set(keys) <= set(v)
            and (k != "started" or "pid" in keys)
            and (k != "refused" or "error" in keys)
        ),
        None,
    )


def test_every_zygote_message_is_a_kind_of_the_protocol():
    sent = _message_keys("worker/zygote.py", "_send") + _message_keys("supervisor/warm.py", "json.dumps")
    kinds = {_kind(keys) for keys in sent}
    assert None not in kinds, [k for k in sent if _kind(k) is None]
    assert kinds == set(contract.ZYGOTE_MESSAGES), "every kind of message is sent by one side"
    initialised = [
        list(_names_in(ast.Tuple(elts=n.value.keys), MODULES["worker/zygote.py"]))
        for n in ast.walk(MODULES["worker/zygote.py"])
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict)
    ]
    assert initialised and all(set(k) <= set(contract.ZYGOTE_MESSAGES["ready"]) for k in initialised), initialised


def test_the_supervisor_reads_only_keys_of_the_protocol():
    keys = set()
    for n in ast.walk(MODULES["supervisor/warm.py"]):
        if (
            isinstance(n, ast.Subscript)
            and isinstance(n.slice, ast.Constant)
            and ast.unparse(n.value) in ("msg", "reply", "self.info")
        ):
            keys.add(n.slice.value)
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "get"
            and ast.unparse(n.func.value) in ("msg", "self.info")
        ):
            keys.update(_names_in(n.args[0], MODULES["supervisor/warm.py"]))
        if (
            isinstance(n, ast.Compare)
            and isinstance(n.ops[0], ast.In)
            and ast.unparse(n.comparators[0]) in ("msg", "reply")
        ):
            keys.update(_names_in(n.left, MODULES["supervisor/warm.py"]))
    assert {"exit", "code", "ready", "error", "pid", "threads"} <= keys, keys
    assert keys <= {k for v in contract.ZYGOTE_MESSAGES.values() for k in v}


def test_the_zygote_knows_every_preload_list_the_supervisor_names():
    from elastic_trainer.worker import zygote

    assert set(zygote.LISTS) == {contract.ZYGOTE_PRELOAD_TRAINER, contract.ZYGOTE_PRELOAD_SCRIPT}


def test_every_variable_the_documents_name_is_in_the_contract_or_read_by_the_scripts():
    """A document or deployment file naming ELASTIC_TRAINER_* means a variable that something reads:
    the package (then it is in the contract) or the setup and test scripts."""
    token = re.compile(r"\bELASTIC_TRAINER_[A-Z_]*[A-Z]\b")
    documents = [
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(p for p in (REPO / "deploy").rglob("*") if p.is_file()),
    ]
    named = {n for p in documents for n in token.findall(p.read_text(errors="replace"))}
    assert {contract.CHECKPOINT_KEY_ENV, contract.NODE_ENV} <= named, "the scan found the documented variables"
    scripts = [*(REPO / "scripts").rglob("*.sh"), *(REPO / "tests").rglob("*.py"), REPO / "Dockerfile"]
    scripts.remove(Path(__file__))
    harness = {n for p in scripts for n in token.findall(p.read_text(errors="replace"))}
    unknown = sorted(named - {v.name for v in contract.ENV_VARS} - harness)
    assert unknown == [], f"documents name variables nothing reads: {unknown}"


def test_nodes_that_share_run_dir_get_their_own_runtime_directories(monkeypatch, tmp_path):
    """run.dir may be one directory every node mounts, and nodes have their own pid spaces (a
    container's supervisor is often pid 1): the metrics directory, wiped at each launch, and the
    watchdog's pipe must not be another node's."""
    import socket

    from elastic_trainer.config import Config, RunConfig
    from elastic_trainer.metrics.prometheus import multiproc_dir

    dirs = {contract.runtime_dir(str(tmp_path), host, 1) for host in ("node-a", "node-b")}
    assert len(dirs) == 2 and all(d.startswith(str(tmp_path / contract.RUNTIME_DIR)) for d in dirs)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    cfg = Config(run=RunConfig(dir=str(tmp_path)))
    assert multiproc_dir(cfg) == str(tmp_path / contract.RUNTIME_DIR / f"node-b-{os.getpid()}" / "prometheus")
