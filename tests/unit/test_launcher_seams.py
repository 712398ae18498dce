"""supervisor/agent.py and options.py: the agent's private shutdown, pinned per torch release.

torch >= 2.12's ``LocalElasticAgent`` takes ``shutdown_timeout`` and ``_shutdown(death_sig, timeout)``;
torch 2.11's takes neither and its torchrun has no ``--shutdown-timeout``: the supervisor's agent
then closes the workers' process context with the timeout itself. A torch that changes either
shape fails here, not in a shutdown (``test_agent_pins.py`` pins every other private the agent uses)."""

from __future__ import annotations

import inspect

import torch
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext

from elastic_trainer.supervisor import agent, options

NEW = torch.__version__ >= "2.12"


def test_the_agent_s_shutdown_takes_a_timeout_exactly_from_torch_2_12():
    assert agent.TAKES_SHUTDOWN_TIMEOUT is NEW
    params = list(inspect.signature(LocalElasticAgent._shutdown).parameters)
    assert params == (["self", "death_sig", "timeout"] if NEW else ["self", "death_sig"])
    # what the branch for older torch calls instead
    assert list(inspect.signature(PContext.close).parameters)[:3] == ["self", "death_sig", "timeout"]
    init = inspect.getsource(LocalElasticAgent.__init__)
    assert "self._pcontext" in init and "self._health_check_server" in init


def test_shutdown_timeout_is_an_option_on_every_torch():
    p = options._get_args_parser()
    assert p.parse_args(["--shutdown-timeout", "7", "train.py"]).shutdown_timeout == 7
    assert p.parse_args(["t.py"]).shutdown_timeout is None  # unset: launch_config applies ours


def test_the_supervised_agent_keeps_the_timeout_it_was_given():
    assert agent.SupervisedAgent.__init__ is not LocalElasticAgent.__init__
    assert inspect.signature(agent.SupervisedAgent.__init__).parameters["shutdown_timeout"].default == 30
