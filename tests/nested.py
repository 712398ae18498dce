"""Comparing nested state dicts in tests."""

from __future__ import annotations

import torch


def assert_same_state(a, b, *, shares_storage: bool) -> None:
    """``a`` and ``b`` hold the same keys, types and values; each tensor pair shares its storage
    (``shares_storage``: a view of the live state) or does not (a copy)."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)
        assert (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()) is shares_storage
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_state(a[k], b[k], shares_storage=shares_storage)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y, shares_storage=shares_storage)
    else:
        assert a == b
