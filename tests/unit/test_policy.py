"""Pure supervisor decisions, table-tested."""

import pytest

from elastic_trainer.config import ConfigError, load_config
from elastic_trainer.supervisor import policy
from elastic_trainer.supervisor.store import StoreAddress


@pytest.mark.parametrize("index, seconds", [(0, 0.0), (1, 0.0), (2, 1.0), (3, 2.0), (4, 4.0), (7, 30.0), (50, 30.0)])
def test_restart_backoff(index, seconds):
    assert policy.restart_backoff(index) == seconds


@pytest.mark.parametrize(
    "previous, healthy, expected",
    [(0, float("inf"), 1), (1, 5.0, 2), (3, 59.9, 4), (3, 60.0, 1), (5, 3600.0, 1)],
)
def test_failure_streak_resets_after_a_healthy_stretch(previous, healthy, expected):
    assert policy.failure_streak(previous, healthy) == expected


@pytest.mark.parametrize(
    "failed, signalled, marker, workers, code",
    [
        (False, False, None, [], 0),
        (False, False, {"step": 5, "exit_code": 75}, [], 0),  # finished after a membership restart left a marker
        (True, False, None, [1], 1),
        (True, False, {"step": 5, "exit_code": 75}, [75, 75], 75),
        (True, False, {"step": 5, "exit_code": 76}, [76, 76], 76),  # the workers said "not committed": so does launch
        (False, True, None, [], 76),  # signalled, but no proof of a commit
        (True, True, None, [], 76),
        (True, True, {"step": 5, "exit_code": 75}, [], 75),
        (True, True, {"step": 5, "exit_code": 76}, [], 76),
        (True, False, None, [65, 65], 65),  # non-finite stop is terminal and reported as such
        (True, False, None, [73, 73], 73),  # fenced
        (True, False, None, [73, 1], 1),  # mixed: a real failure
        (True, False, None, [2, 2], 2),  # a checkpoint the code cannot take (or none loads): terminal
        (True, False, {"step": 5, "exit_code": 69}, [69, 69], 69),  # this node was excluded: it leaves the job
        (True, False, None, [75, 75], 75),  # no marker (a script under run): the workers' codes say it
        (True, False, None, [75, 76], 76),
        (True, False, None, [75, 1], 1),
        (True, True, None, [75, 75], 75),
        (True, True, None, [75, 76], 76),
    ],
)
def test_launch_exit_code(failed, signalled, marker, workers, code):
    assert (
        policy.launch_exit_code(failed=failed, signalled=signalled, preempt_marker=marker, worker_exit_codes=workers)
        == code
    )


@pytest.mark.parametrize(
    "codes, terminal",
    [
        ([65, 65], 65),
        ([73], 73),
        ([2, 2], 2),
        ([2], 2),
        ([65, 73], None),
        ([2, 1], None),
        ([1], None),
        ([75, 75], None),
        ([69, 69], 69),  # the excluded node
        ([79, 79], None),  # a node that stays re-forms the group
        ([], None),
    ],
)
def test_terminal_codes_stop_restarts(codes, terminal):
    assert policy.terminal_code(codes) == terminal


@pytest.mark.parametrize(
    "codes, how",
    [([69, 69], "leave"), ([69], "leave"), ([79, 79], "regroup"), ([79, 1], None), ([69, 79], None), ([65], None)],
)
def test_a_round_ended_for_an_excluded_node(codes, how):
    assert policy.ends_round(codes) == how


@pytest.mark.parametrize(
    "codes, marker, terminal",
    [
        ([74, 74], {"exit_code": 74, "restartable": False}, 74),  # disk full: a restart cannot make room
        ([74, 74], {"exit_code": 74, "restartable": True}, None),  # transient: restart as before
        ([74, 74], {"exit_code": 74}, None),  # a marker of an earlier version
        ([74, 74], None, None),
        ([74, 1], {"exit_code": 74, "restartable": False}, None),
    ],
)
def test_a_final_save_that_failed_for_good_is_terminal(codes, marker, terminal):
    assert policy.terminal_code(codes, marker) == terminal


@pytest.mark.parametrize(
    "failed, before, after, refund",
    [
        (True, 2, 1, True),
        (True, 3, 2, True),
        (True, 2, 2, False),
        (False, 1, 2, False),
        (False, 2, 1, False),
        (True, 1, 2, False),
    ],
)
def test_refund_restart_only_for_a_failure_that_lost_a_node(failed, before, after, refund):
    assert policy.refund_restart(failed=failed, nodes_before=before, nodes_after=after) is refund


@pytest.mark.parametrize("failed, grace", [(True, 5.0), (False, 75.0)])
def test_stop_grace(failed, grace):
    assert policy.stop_grace_seconds(failed=failed, preempt_shutdown=75.0) == grace


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("foo=1", "unknown rendezvous setting 'foo'"),
        ("last_call_timeout=x", "positive integer"),
        ("last_call_timeout=0.5", "positive integer"),
        ("keep_alive_interval=0", "positive number of seconds"),
        ("keep_alive_interval=-0.5", "positive number of seconds"),
        ("keep_alive_interval=nan", "positive number of seconds"),
        ("keep_alive_interval=inf", "positive number of seconds"),
        ("keep_alive_interval=fast", "positive number of seconds"),
        ("is_host=maybe", "true or false"),
        ("novalue", "key=value"),
    ],
)
def test_rdzv_conf_errors_name_the_key(value, fragment):
    with pytest.raises(ConfigError, match="elastic.rdzv_conf") as e:
        load_config(None, [f'elastic.rdzv_conf="{value}"', "data.path=x", "checkpoint.dir=/tmp/x"])
    assert fragment in str(e.value)


def test_the_keep_alive_interval_may_be_a_fraction_of_a_second():
    cfg = load_config(None, ['elastic.rdzv_conf="keep_alive_interval=0.5"', "data.path=x", "checkpoint.dir=/tmp/x"])
    assert cfg.elastic.rdzv_conf == "keep_alive_interval=0.5"


@pytest.mark.parametrize(
    "endpoint, addr",
    [("h:1", StoreAddress("h", 1)), ("h", StoreAddress("h", 29400)), ("[::1]:5", StoreAddress("::1", 5))],
)
def test_store_address(endpoint, addr):
    assert StoreAddress.parse(endpoint) == addr


@pytest.mark.parametrize("endpoint", ["h:x", ":5", "h:70000"])
def test_store_address_errors(endpoint):
    with pytest.raises(ValueError):
        StoreAddress.parse(endpoint)
