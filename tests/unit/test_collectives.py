"""elastic_trainer.collectives: our agreements return only once gloo has let go of the tensor
(else a run's last agreement could abort the interpreter's exit), and the private torch seam
this needs (``Tensor._use_count``) — these tests fail loudly when torch changes it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from elastic_trainer import collectives
from tests import runs
from tests.fixtures.procs import free_port

pytestmark = pytest.mark.timeout(120)

_CHILD = """
import torch, torch.distributed as dist
from elastic_trainer import collectives
dist.init_process_group("gloo", rank=0, world_size=1)
t = torch.ones(4)
assert t._use_count() == 1, t._use_count()
work = dist.all_reduce(t, async_op=True)
assert t._use_count() > 1, "a collective in flight must show as a reference to the tensor"
work.wait()
del work
assert collectives.wait_released(t, 1, timeout=10), "the backend never released the tensor"
for _ in range(200):
    u = torch.full((3,), 2.0)
    collectives.all_reduce(u)
    assert u._use_count() == 1, u._use_count()
    assert u.tolist() == [2.0, 2.0, 2.0]
dist.destroy_process_group()
print("ok")
"""


def test_use_count_sees_the_backend_holding_a_tensor_and_all_reduce_returns_after_release():
    env = runs.env_for_tests({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    r = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, cwd=runs.REPO, timeout=100
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_wait_released_is_bounded():
    t = torch.ones(2)
    assert collectives.wait_released(t, 1, timeout=0.05) is True
    assert collectives.wait_released(t, 0, timeout=0.05) is False, (
        "a reference that never goes returns after the timeout"
    )
