"""supervisor/agent.py: every private of torch's elastic agent the supervised agent relies on,
pinned. Each method it overrides keeps the exact signature recorded here (parameter names, kinds
and defaults), each attribute of torch's agent it reads exists on a freshly built agent, and the
module-level privates it calls keep theirs. A torch release that changes one fails here, naming
it, before any agent runs; ``test_a_changed_*`` show the check does fail."""

from __future__ import annotations

import ast
import functools
import inspect
import signal
import textwrap

import pytest
import torch
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer
from torch.distributed.launcher import api as launcher_api

from elastic_trainer.events import EventLog
from elastic_trainer.supervisor import agent
from elastic_trainer.supervisor.journal import Journal
from elastic_trainer.supervisor.liveness import NodeLiveness
from elastic_trainer.supervisor.restarts import RestartLedger
from elastic_trainer.supervisor.warm import WarmStart

NEW = torch.__version__ >= "2.12"  # torch 2.11's agent takes no shutdown timeout (test_launcher_seams.py)
SIGTERM = repr(signal.SIGTERM)

# (owner, name) -> the signature the override or the call was written against
PINNED_SIGNATURES = {
    (LocalElasticAgent, "_monitor_workers"): "(self, worker_group)",
    (LocalElasticAgent, "_start_workers"): "(self, worker_group)",
    (LocalElasticAgent, "_setup_local_watchdog"): "(self, envs)",
    (LocalElasticAgent, "_stop_workers"): "(self, worker_group)",
    (LocalElasticAgent, "_shutdown"): f"(self, death_sig={SIGTERM}, timeout=30)"
    if NEW
    else f"(self, death_sig={SIGTERM})",
    (LocalElasticAgent, "_rendezvous"): "(self, worker_group)",
    (LocalElasticAgent, "_log_watchdog_event"): "(self, name, request)",
    (LocalElasticAgent, "_restart_workers"): "(self, worker_group)",
    (FileTimerServer, "_reap_worker"): "(self, worker_pid, signal)",
    (launcher_api, "_get_addr_and_port"): "(rdzv_parameters)",
}
# attributes of torch's agent that SupervisedAgent reads -> the type a freshly built agent holds
PINNED_ATTRIBUTES = {
    "_remaining_restarts": int,
    "_worker_group": WorkerGroup,
    "_pcontext": type(None),
    "_worker_watchdog": type(None),
    "_health_check_server": type(None),
    **({"_shutdown_timeout": int} if NEW else {}),  # torch 2.11: the supervised agent keeps its own
}
# the constructor's parameters the supervised agent passes on
PINNED_INIT = ["spec", "logs_specs", "start_method", "log_line_prefix_template", *(["shutdown_timeout"] if NEW else [])]
# SupervisedAgent's own state (everything else it reads of ``self`` is torch's)
OWN_ATTRIBUTES = {"_journal", "_ledger", "_liveness", "_warm", "_last_result"}


def shape(fn) -> str:
    """A signature without annotations (torch writes them as strings in some releases)."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def torch_agent() -> LocalElasticAgent:
    """torch's agent as the launcher builds it, without a rendezvous (the handler is never called)."""
    spec = WorkerSpec(role="pin", local_world_size=1, rdzv_handler=object(), entrypoint="true", max_restarts=3)
    return LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(), start_method="spawn")


def pin_report() -> list[str]:
    """One line per private of torch's that is not as pinned (empty: all hold)."""
    version = f"torch {torch.__version__}"
    problems = []
    for (owner, name), want in PINNED_SIGNATURES.items():
        where = f"{owner.__name__}.{name}"
        fn = getattr(owner, name, None)
        if fn is None:
            problems.append(f"{where}: gone in {version} (pinned {name}{want})")
        elif (got := shape(fn)) != want:
            problems.append(f"{where}: {version} has {name}{got}, the supervised agent was written for {name}{want}")
    state = vars(torch_agent())
    for name, kind in PINNED_ATTRIBUTES.items():
        if name not in state:
            problems.append(f"LocalElasticAgent().{name}: gone in {version} (the supervised agent reads it)")
        elif not isinstance(state[name], kind):
            got = type(state[name]).__name__
            problems.append(f"LocalElasticAgent().{name}: a {got} in {version}, pinned as {kind.__name__}")
    params = inspect.signature(LocalElasticAgent.__init__).parameters
    problems += [f"LocalElasticAgent.__init__: no parameter {p!r} in {version}" for p in PINNED_INIT if p not in params]
    return problems


def private_reads(cls) -> set[str]:
    """Every ``self._name`` the class's source uses that it does not define itself (its methods
    and :data:`OWN_ATTRIBUTES`): what it reads of torch's agent."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    }
    return used - set(vars(cls)) - OWN_ATTRIBUTES


def test_every_private_of_torch_s_agent_is_as_pinned():
    problems = pin_report()
    assert not problems, "torch changed what the supervised agent relies on:\n" + "\n".join(problems)


def overrides(cls, base) -> set[str]:
    """The private (not dunder) methods of ``base`` that ``cls`` defines again."""
    own = vars(cls)
    return {
        n
        for n in own
        if n.startswith("_") and not n.startswith("__") and inspect.isfunction(own[n]) and hasattr(base, n)
    }


def test_every_override_and_every_attribute_read_is_pinned():
    for cls, base in ((agent.SupervisedAgent, LocalElasticAgent), (agent.AgentSafeFileTimerServer, FileTimerServer)):
        assert overrides(cls, base) == {name for owner, name in PINNED_SIGNATURES if owner is base}
    reads = private_reads(agent.SupervisedAgent)
    if not NEW:
        reads -= {"_shutdown_timeout"}  # its own there
    assert reads == set(PINNED_ATTRIBUTES)


def test_a_changed_signature_is_reported_by_name(monkeypatch):
    def _stop_workers(self, worker_group, is_restart=False):  # a torch that grew a parameter
        pass

    monkeypatch.setattr(LocalElasticAgent, "_stop_workers", _stop_workers)
    (problem,) = pin_report()
    assert problem == (
        f"LocalElasticAgent._stop_workers: torch {torch.__version__} has _stop_workers(self, worker_group, "
        "is_restart=False), the supervised agent was written for _stop_workers(self, worker_group)"
    )
    monkeypatch.delattr(LocalElasticAgent, "_log_watchdog_event")
    assert any(p.startswith("LocalElasticAgent._log_watchdog_event: gone in torch") for p in pin_report())


def test_a_missing_attribute_is_reported_by_name(monkeypatch):
    init = LocalElasticAgent.__init__

    @functools.wraps(init)
    def without_pcontext(self, *args, **kwargs):  # a torch that renamed it
        init(self, *args, **kwargs)
        self._processes = self.__dict__.pop("_pcontext")

    monkeypatch.setattr(LocalElasticAgent, "__init__", without_pcontext)
    assert pin_report() == [
        f"LocalElasticAgent()._pcontext: gone in torch {torch.__version__} (the supervised agent reads it)"
    ]


def test_the_scan_finds_what_a_subclass_reads_of_its_base():
    class Reader(LocalElasticAgent):
        def _own(self):
            return self._journal

        def read(self):
            return self._own(), self._pcontext, self.__class__

    assert private_reads(Reader) == {"_pcontext"}


def _supervised_agent(tmp_path, max_restarts=3) -> agent.SupervisedAgent:
    spec = WorkerSpec(
        role="pin", local_world_size=2, rdzv_handler=object(), entrypoint="true", max_restarts=max_restarts
    )
    journal = Journal(EventLog(str(tmp_path / "events.jsonl")))
    return agent.SupervisedAgent(
        spec,
        journal=journal,
        ledger=RestartLedger(journal),
        liveness=NodeLiveness(spec.rdzv_handler, journal, watch=False),
        warm=WarmStart(None, journal),
        logs_specs=DefaultLogsSpecs(),
        start_method="spawn",
        log_line_prefix_template=None,
        shutdown_timeout=7,
    )


def test_the_supervised_agent_is_built_from_its_collaborators_without_a_rendezvous(tmp_path):
    a = _supervised_agent(tmp_path)
    assert vars(a)["_shutdown_timeout"] == 7  # torch's own from 2.12, the agent's on 2.11
    assert vars(a)["_remaining_restarts"] == 3
    # what the launcher asks of it before any worker runs
    assert (a.workers_running(), a.kill_workers(), a.worker_exit_codes()) == (False, [], [])


@pytest.mark.parametrize("code, restarted, ends_excluded", [(79, True, False), (69, False, True), (1, False, False)])
def test_a_round_ended_for_an_excluded_node_restarts_the_others_without_using_a_restart(
    tmp_path, monkeypatch, code, restarted, ends_excluded
):
    """Workers that all exit 79 (a node that stays) are restarted at once as a membership change,
    even with no restart left; 69 (the excluded node) stops restarting; any other failure is
    torch's to count."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {i: ProcessFailure(local_rank=i, pid=100 + i, exitcode=code, error_file="") for i in range(2)}
    failed = RunResult(state=WorkerState.FAILED, failures=failures)
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: failed)
    a = _supervised_agent(tmp_path, max_restarts=0)
    restarts = []
    monkeypatch.setattr(a, "_restart_workers", lambda group: restarts.append(agent._failed(a._last_result)))
    a._worker_group.group_world_size = 2
    result = a._monitor_workers(a._worker_group)
    assert restarts == ([False] if restarted else [])  # not a failure restart: no back-off, nothing counted
    assert result.is_failed() != restarted and vars(a)["_remaining_restarts"] == 0
    assert agent.excluded(result) == ends_excluded
