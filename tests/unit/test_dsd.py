"""checkpoint/dsd.py: the model's and optimizer's state dicts exactly as torch's public
functions return them, the layout verified once while it holds and again when it changes."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from elastic_trainer.checkpoint import dsd
from elastic_trainer.checkpoint.dsd import StateDicts
from tests.nested import assert_same_state


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 6))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # shared: two FQNs, one tensor
        self.register_buffer("scale", torch.ones(6))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return self.head(self.body(self.emb(x) * self.scale))


def _trained():
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randint(0, 11, (4, 5))).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_the_private_names_it_uses_exist_with_the_signatures_it_calls():
    # torch renaming or reshaping one of these must fail here, not in a save
    assert list(inspect.signature(dsd._verify_options).parameters)[:3] == ["model", "optims", "optim_only"]
    assert list(inspect.signature(dsd._get_model_state_dict).parameters) == ["model", "info"]
    assert list(inspect.signature(dsd._get_optim_state_dict).parameters) == ["model", "optimizers", "info"]
    assert list(inspect.signature(dsd._verify_state_dict).parameters) == [
        "model_state_dict",
        "optim_state_dict",
        "info",
    ]


def test_state_dicts_equal_torch_s_public_functions_and_verify_the_layout_once():
    model, opt = _trained()
    m, o = StateDicts(model), StateDicts(model, opt)
    for _ in range(3):
        assert_same_state(m.model_state_dict(), get_model_state_dict(model), shares_storage=True)
        assert_same_state(o.optimizer_state_dict(), get_optimizer_state_dict(model, opt), shares_storage=True)
        opt.step()  # the values move between saves; the layout does not
    assert (m.verified, o.verified) == (1, 1)
    # read afresh: an in-place update is in the next state dict
    with torch.no_grad():
        model.body[0].weight.add_(1.0)
    assert torch.equal(m.model_state_dict()["body.0.weight"], model.body[0].weight)
    assert m.verified == 1


@pytest.mark.parametrize("change", ["parameter", "buffer", "param_group", "submodule"])
def test_a_changed_layout_is_verified_again(change):
    model, opt = _trained()
    m, o = StateDicts(model), StateDicts(model, opt)
    m.model_state_dict(), o.optimizer_state_dict()
    if change == "parameter":
        model.body[0].weight = nn.Parameter(torch.full((6, 6), 3.0))
    elif change == "buffer":
        model.scale = torch.full((6,), 2.0)
    elif change == "param_group":
        model.extra = nn.Linear(6, 2)
        opt.add_param_group({"params": list(model.extra.parameters())})
    else:
        model.body[2] = nn.Linear(6, 6)
    assert_same_state(m.model_state_dict(), get_model_state_dict(model), shares_storage=True)
    assert m.verified == 2
    if change == "param_group":
        assert_same_state(o.optimizer_state_dict(), get_optimizer_state_dict(model, opt), shares_storage=True)
        assert o.verified == 2


def test_a_model_loaded_in_place_is_not_copied_onto_itself(tmp_path, monkeypatch):
    """DCP's load reads into the tensors ``ModelState.state_dict()`` returned, which are the
    model's own: the model then holds the checkpoint, and ``set_model_state_dict`` (a second copy
    of every tensor onto itself) is skipped; any other dict is set the usual way."""
    import torch.distributed.checkpoint as dcp

    from elastic_trainer.checkpoint import state

    model, _ = _trained()
    dcp.save({"model": state.ModelState(model)}, checkpoint_id=str(tmp_path), no_dist=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = Tied()
    set_calls = []
    real_set = state.set_model_state_dict
    monkeypatch.setattr(state, "set_model_state_dict", lambda *a, **k: set_calls.append(1) or real_set(*a, **k))
    loaded = state.ModelState(fresh)
    dcp.load({"model": loaded}, checkpoint_id=str(tmp_path), no_dist=True)
    assert not set_calls, "the model was copied onto itself"
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k
    other = {k: torch.zeros_like(v) for k, v in fresh.state_dict().items()}
    loaded.load_state_dict(other)
    assert set_calls == [1] and all(torch.equal(v, torch.zeros_like(v)) for v in fresh.state_dict().values())
