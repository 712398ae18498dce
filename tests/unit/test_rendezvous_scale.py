"""How many nodes one c10d rendezvous carries: every heartbeat is a compare-and-set of one key
holding every node's (bench/scale.py measured the turn each takes), so a node's heartbeat lands
about every turn × N²; ``config check`` and ``launch`` warn when that passes half the liveness
bound, naming the settings that carry the node count."""

from __future__ import annotations

import pytest

from elastic_trainer import cli
from elastic_trainer.config import config_from_dict, parse_rdzv_conf
from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor import options
from elastic_trainer.supervisor.launcher import build_launch_config, rendezvous_scale_warning
from elastic_trainer.supervisor.liveness import heartbeat_period_seconds, scale_warning

DEFAULT = parse_rdzv_conf("last_call_timeout=1,keep_alive_interval=0.25,keep_alive_max_attempt=8")


def test_the_heartbeat_period_grows_with_the_square_of_the_nodes():
    assert heartbeat_period_seconds(2048) == pytest.approx(4 * heartbeat_period_seconds(1024))
    assert heartbeat_period_seconds(16) < 0.01


@pytest.mark.parametrize("nodes", [2, 16, 128, 256])
def test_the_default_settings_carry_a_few_hundred_nodes(nodes):
    assert scale_warning("c10d", nodes, DEFAULT) is None


def test_past_them_the_warning_names_the_bound_the_node_count_needs_and_that_bound_is_enough():
    why = scale_warning("c10d", 1024, DEFAULT)
    assert why is not None
    assert "1024 nodes" in why and "liveness bound of 2 s" in why
    assert "keep_alive_interval x keep_alive_max_attempt" in why
    need = 2 * heartbeat_period_seconds(1024)
    assert f">= {need:.0f} s" in why
    assert scale_warning("c10d", 1024, {"keep_alive_interval": str(need / 3), "keep_alive_max_attempt": "3"}) is None


def test_torch_s_own_keep_alive_applies_when_none_is_set():
    # torch's 5 s x 3: a 15 s bound carries about 760 nodes
    assert scale_warning("c10d", 700, {}) is None
    assert "keep_alive_interval=5 x keep_alive_max_attempt=3" in (scale_warning("c10d", 1000, {}) or "")


def test_config_check_warns_on_stderr_and_still_prints_the_config(tmp_path, capsys):
    cfg = tmp_path / "big.toml"
    cfg.write_text('[elastic]\nnnodes = "64:1024"\nrdzv_endpoint = "10.0.0.1:29400"\n')
    assert cli.main(["config", "check", str(cfg)]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("warning: elastic.nnodes: up to 1024 nodes") and '"elastic"' in out
    assert cli.main(["config", "check", str(cfg), "--set", "elastic.nnodes=2:64"]) == 0
    assert capsys.readouterr().err == ""


def test_other_backends_and_one_node_are_not_judged():
    assert scale_warning("static", 4096, DEFAULT) is None and scale_warning("c10d", 1, DEFAULT) is None


def test_launch_judges_the_node_count_its_flags_and_environment_resolve_to(monkeypatch):
    """``launch``/``run`` warn from the launch config they start with: ``--nnodes`` and
    ``PET_RDZV_CONF`` over the config file's values."""
    cfg = config_from_dict({"elastic": {"nnodes": "2:64", "rdzv_endpoint": "10.0.0.1:29400"}})

    def warning(argv: list[str]) -> str | None:
        a, explicit = options.parse_explicit(options.launch_parser(), ["c.toml", *argv])
        a.training_script, a.training_script_args, a.module = options.WORKER_MODULE, [], True  # as launch sets it
        config, _, _ = build_launch_config(cfg, a, explicit)
        return rendezvous_scale_warning(config)

    assert warning([]) is None
    assert "up to 1024 nodes" in (warning(["--nnodes", "64:1024"]) or "")
    monkeypatch.setenv("PET_RDZV_CONF", "keep_alive_interval=10,keep_alive_max_attempt=3")
    assert warning(["--nnodes", "64:1024"]) is None


def test_past_the_c10d_limit_the_warning_names_the_package_s_own_rendezvous():
    assert 'elastic.rdzv_backend = "elastic-trainer"' in (scale_warning("c10d", 1024, DEFAULT) or "")


def test_the_own_rendezvous_carries_a_thousand_nodes_at_the_default_cadence_and_names_what_more_need():
    """Its store load is linear: N x (1/keep_alive_interval + 1/rdzv_poll_seconds) operations a
    second, judged against the budget bench/scale.py --keyed measured."""
    assert scale_warning("elastic-trainer", 1024, DEFAULT, 0.2) is None  # 9,216 operations a second
    why = scale_warning("elastic-trainer", 4096, DEFAULT, 0.2)
    assert why is not None and "36,864 store operations a second" in why and "at least 0.82 s" in why
    one_second = {**DEFAULT, "keep_alive_interval": "1"}
    assert scale_warning("elastic-trainer", 4096, one_second, 1.0) is None
    assert scale_warning("elastic-trainer", 10000, one_second, 1.0) is not None
    assert scale_warning("elastic-trainer", 10000, {**DEFAULT, "keep_alive_interval": "2"}, 2.0) is None


def test_the_own_rendezvous_polls_up_to_ten_seconds_and_torch_s_up_to_one():
    own = {"rdzv_backend": "elastic-trainer", "rdzv_poll_seconds": 2.0}
    assert config_from_dict({"elastic": own}).elastic.rdzv_poll_seconds == 2.0
    with pytest.raises(ConfigError, match="elastic.rdzv_poll_seconds"):
        config_from_dict({"elastic": {"rdzv_poll_seconds": 2.0}})
    with pytest.raises(ConfigError, match="<= 10"):
        config_from_dict({"elastic": {**own, "rdzv_poll_seconds": 11}})
