"""Checks the EMU tests share."""

import torch


def assert_bitwise(m, unit) -> None:
    """``unit``'s gathered state equals its stage's reference state, tensor for tensor.

    Arguments:
        m: the EMUManager that holds ``unit``.
        unit: a live EMU.
    """
    ref, got = m.reference(unit.stage), m.full_state(unit)
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(got[name], t), f"{unit!r}: {name} differs"
