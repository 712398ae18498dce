"""What a save sends the writer process (``checkpoint.writer = "process"``,
elastic_trainer.checkpoint.writer_process): the kept staged copy's tensors once per writer
process, then only the state's structure with references to them and the values that are not
tensors — and the writer, a real spawned process, reads every save's own bytes and values."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from elastic_trainer.checkpoint import writer_process
from elastic_trainer.checkpoint.savers import staging_options
from elastic_trainer.checkpoint.staging import KeptStager

pytestmark = pytest.mark.timeout(120)


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.full((64, 8), float(step)), "b": torch.arange(8.0) + step},
        "optim": {
            "state": {"w": {"step": torch.tensor(float(step)), "exp_avg": torch.full((64, 8), -float(step))}},
            "param_groups": [{"lr": 0.1 * step, "params": ["w"], "betas": (0.9, 0.95)}],
        },
        "cursor": {"step": step, "name": f"s{step}"},
    }


def _writer(conn) -> None:
    """Stands in for DCP's writer process: unpickles each shipment (``_unship``), answers what it
    got and whether it used the tensors it already held."""
    held = None
    while (state := conn.recv()) is not None:
        tensors = next(iter(writer_process._received.values()))
        conn.send(
            {
                "w": state["model"]["w"].sum().item(),
                "b": state["model"]["b"].tolist(),
                "step": state["optim"]["state"]["w"]["step"].item(),
                "exp_avg": state["optim"]["state"]["w"]["exp_avg"].sum().item(),
                "lr": state["optim"]["param_groups"][0]["lr"],
                "cursor": state["cursor"],
                "same_tensors": tensors is held,
                "shared": all(t.is_shared() for t in tensors),
            }
        )
        held = tensors


def _expected(step: int) -> dict:
    s = _state(step)
    return {
        "w": s["model"]["w"].sum().item(),
        "b": s["model"]["b"].tolist(),
        "step": float(step),
        "exp_avg": s["optim"]["state"]["w"]["exp_avg"].sum().item(),
        "lr": 0.1 * step,
        "cursor": s["cursor"],
    }


def test_the_writer_gets_the_kept_tensors_once_and_reads_each_save_s_bytes_through_them(monkeypatch):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(theirs,), daemon=True)
    writer.start()

    class Slot:  # what DCP's writer slot holds: a new object for every writer process
        pass

    slot = [Slot()]
    monkeypatch.setattr(writer_process, "_writer", lambda: slot[0])  # DCP's slot holds no process here
    stager = KeptStager(staging_options(cuda=False, shared_memory=True), for_writer_process=True)
    try:

        def save(step: int, state: dict | None = None) -> tuple[bool, dict]:
            """(whether the writer got tensors with this save, what it read)"""
            shipment = stager.stage(state or _state(step)).result()
            assert isinstance(shipment, writer_process.Shipment)
            ours.send(shipment)
            assert ours.poll(60), "the writer did not answer"
            got = ours.recv()
            return not got["same_tensors"], got

        answers = {}
        for step in (1, 2, 3):
            answers[step] = save(step)
        assert [sent for sent, _ in answers.values()] == [True, False, False]
        for step, (_, got) in answers.items():
            assert {k: got[k] for k in _expected(step)} == _expected(step), step
            assert got["shared"]

        slot[0] = Slot()  # another writer process (the previous one died and was replaced)
        sent, got = save(4)
        assert sent and got["w"] == _expected(4)["w"]
        sent, got = save(5)
        assert not sent and got["exp_avg"] == _expected(5)["exp_avg"]

        grown = _state(6)
        grown["model"]["new"] = torch.ones(3)  # another layout: a new kept copy, sent in full
        sent, got = save(6, grown)
        assert sent and got["w"] == _expected(6)["w"] and got["cursor"] == {"step": 6, "name": "s6"}
        assert stager.deep_copies == 2
    finally:
        ours.send(None)
        writer.join(30)
        stager.close()


def test_a_shipment_the_writer_never_received_fails_loudly():
    with pytest.raises(RuntimeError, match="never received"):
        writer_process._unship(10**9, None, {"w": writer_process._Ref(0)})


def test_the_thread_writer_s_stager_stages_plain_state_dicts():
    stager = KeptStager(staging_options(cuda=False, shared_memory=False))
    try:
        assert isinstance(stager.stage(_state(1)).result(), dict)
    finally:
        stager.close()
