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
