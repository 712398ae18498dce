"""The process-group harness itself: a port another process takes between its choice and rank
0's bind is chosen again, instead of failing the test that asked for ranks."""

from __future__ import annotations

import socket

from . import harness


def _world(rank: int, world: int) -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_a_port_taken_before_rank_0_binds_it_is_chosen_again(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    chosen = []
    real = getattr(harness, "_free_port")  # noqa: B009 - the harness's own port choice, wrapped

    def first_taken() -> int:
        port = taken.getsockname()[1] if not chosen else real()
        chosen.append(port)
        return port

    monkeypatch.setattr(harness, "_free_port", first_taken)
    try:
        assert harness.run_ranks(_world, 2, timeout=60) == [2, 2]
    finally:
        taken.close()
    assert len(chosen) == 2 and chosen[0] != chosen[1], "the taken port was chosen again"
