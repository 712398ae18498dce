"""bench/checkpoint_stall.py drives torchtitan's CheckpointManager through our training step with
a stand-in for our manager (``_PeerManager``): every attribute the run's step hooks (what the
step context calls) read of its manager must exist on the stand-in, or the side-by-side
benchmark breaks at its first step."""

from __future__ import annotations

import ast
import importlib.util

from tests import runs


def _checkpointer_methods_the_step_calls() -> set[str]:
    tree = ast.parse((runs.REPO / "elastic_trainer" / "runtime" / "step.py").read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "ckpt"
    } | {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and getattr(node.func.value, "id", "") == "ck"
    }


def _attributes_read_by_the_step(owner: str) -> set[str]:
    """What the run's step hooks read of ``self._run.<owner>`` (the manager, its ``fault_hooks``)."""
    hooks = _checkpointer_methods_the_step_calls()
    tree = ast.parse((runs.REPO / "elastic_trainer" / "runtime" / "run.py").read_text())
    return {
        node.attr
        for method in ast.walk(tree)
        if isinstance(method, ast.FunctionDef) and method.name in hooks
        for node in ast.walk(method)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == owner
    }


def test_the_torchtitan_stand_in_has_every_manager_attribute_the_step_reads():
    spec = importlib.util.spec_from_file_location("checkpoint_stall", runs.REPO / "bench" / "checkpoint_stall.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    used = _attributes_read_by_the_step("manager")
    assert {"votes", "agreed", "fault_hooks"} <= used, used  # the walk finds them
    assert not {name for name in used if not hasattr(bench._PeerManager, name)}
    hooks = _attributes_read_by_the_step("fault_hooks")
    assert {"commit_visible", "inject_local_faults"} <= hooks, hooks
    assert not {name for name in hooks if not hasattr(bench._PeerManager.fault_hooks, name)}


def _load_peers():
    spec = importlib.util.spec_from_file_location("checkpoint_peers", runs.REPO / "bench" / "checkpoint_peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    return peers


def test_every_peer_has_a_pinned_requirements_file_and_says_what_durable_means():
    peers = _load_peers()
    for name, modes in peers.PEER_MODES.items():
        package = peers._package(name)
        pins = (runs.REPO / "bench" / f"requirements-{package}.txt").read_text()
        assert any(line.startswith(f"{package}==") for line in pins.splitlines()), package
        assert all(mode in peers.DURABLE for mode in modes), name
    assert "thread" in peers.DURABLE  # ours


def test_a_peer_that_is_not_installed_names_the_venv_command():
    import subprocess
    import sys

    peers = _load_peers()
    missing = peers.missing_peers(["torchtitan", "torch-checkpointing", "lm-resiliency", "dlrover"])
    hint = peers.install_hint("dlrover")
    assert "python -m venv .bench-venv" in hint and "bench/requirements-dlrover.txt" in hint
    if not missing:  # run from the bench venv: every peer is importable
        return
    out = subprocess.run(
        [sys.executable, str(runs.REPO / "bench" / "checkpoint_stall.py"), "--peer", missing[0]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert ".bench-venv/bin/pip install -r bench/requirements-" in out.stderr
