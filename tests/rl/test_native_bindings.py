"""nereus_rl._native's bindings refuse malformed input with a Python exception.

The planner bindings (PartitionIndex, PlanContext) read numpy arrays and the
transition front reads tuples with CPython's unchecked macros: without their checks,
a wrong shape, an out-of-range start or a non-tuple read out of bounds (or divided
by zero) and could crash the process. Every case runs in one child process, so a
case that crashes fails its own test and this process survives; each prints the
name of the exception it raised.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_CHILD = r"""
import json, sys, types
import numpy as np
from nereus_rl import _native
from nereus_rl.planner.bounds import PartitionBounds
from nereus_rl.transition.types import Unit

pb = PartitionBounds(3, 8)
idx, starts, masks = pb.idx, pb.starts, [list(m) for m in pb.masks]
lay = _native.StageLayouts(np.array([1, 2], np.int64), np.array([1, 2], np.int64))
times = np.zeros(6)

def stage(units, tp=1, pp=1, name="rollout"):
    return types.SimpleNamespace(stage=name, model="actor", trains=False, tp=tp, pp=pp,
                                 units=units)

def unit(devices=(0,), tp=1, pp=1, uid="rollout#0"):
    return Unit(uid, "rollout", "actor", False, tp, pp, devices)

def front(current, from_plan=False, target=None, devices=None, lost=(), cls=Unit):
    target = (stage(((1,),)),) if target is None else target
    return _native.transition_front(current, from_plan, target, devices, list(lost), cls)

CASES = {
    "index_valid": lambda: _native.PartitionIndex(idx, starts, masks, 8),
    "index_N_zero": lambda: _native.PartitionIndex(idx, starts, masks, 0),
    "index_start_past_rows": lambda: _native.PartitionIndex(
        idx, np.where(np.arange(len(starts)) == 1, 10**9, starts), masks, 8),
    "index_negative_start": lambda: _native.PartitionIndex(idx, starts - 5, masks, 8),
    "index_more_groups_than_rows": lambda: _native.PartitionIndex(
        idx[:1], starts, masks, 8),
    "index_mask_past_stages": lambda: _native.PartitionIndex(
        idx, starts, [[1 << 20]] + masks[1:], 8),
    "index_1d": lambda: _native.PartitionIndex(idx[0], starts, masks, 8),
    "context_valid": lambda: _native.PlanContext(times, [lay] * 3, [0, 1, 2], -1, -1, 10, 8, 8,
                                                 True),
    "context_none_layout": lambda: _native.PlanContext(times, [lay, None, lay], [0, 1, 2], -1,
                                                       -1, 10, 8, 8, True),
    "context_negative_stage": lambda: _native.PlanContext(times, [lay] * 3, [0, 1, 2], -7, -1,
                                                          10, 8, 8, True),
    "context_short_times": lambda: _native.PlanContext(times[:2], [lay] * 3, [0, 1, 2], -1, -1,
                                                       10, 8, 8, True),
    "front_valid": lambda: front((unit(),)),
    "front_units_list": lambda: front([unit()]),
    "front_unit_short_tuple": lambda: front((("rollout#0", "rollout"),)),
    "front_unit_not_tuple": lambda: front((5,)),
    "front_tp_float": lambda: front((unit(tp=1.5),)),
    "front_tp_bool": lambda: front((unit(tp=True),)),
    "front_devices_int": lambda: front((unit(devices=3),)),
    "front_device_bool": lambda: front((unit(devices=(True,)),)),
    "front_uid_int": lambda: front((unit(uid=7),)),
    "front_cls_none": lambda: front((unit(),), cls=None),
    "front_cls_not_tuple": lambda: front((unit(),), cls=dict),
    "front_plan_units_list": lambda: front((stage([(0,)]),), from_plan=True),
    "front_plan_unit_devices_int": lambda: front((stage((0,)),), from_plan=True),
    "front_target_pp_float": lambda: front((unit(),), target=(stage(((1,),), pp=2.0),)),
}

for name, call in list(CASES.items())[int(sys.argv[1]):]:
    try:
        call()
        got = "ok"
    except Exception as e:
        got = type(e).__name__
    print(json.dumps([name, got]), flush=True)
"""

EXPECTED = {
    "index_valid": "ok",
    "index_N_zero": "ValueError",
    "index_start_past_rows": "ValueError",
    "index_negative_start": "ValueError",
    "index_more_groups_than_rows": "ValueError",
    "index_mask_past_stages": "ValueError",
    "index_1d": "ValueError",
    "context_valid": "ok",
    "context_none_layout": "ValueError",
    "context_negative_stage": "ValueError",
    "context_short_times": "ValueError",
    "front_valid": "ok",
    "front_units_list": "TypeError",
    "front_unit_short_tuple": "ValueError",
    "front_unit_not_tuple": "TypeError",
    "front_tp_float": "TypeError",
    "front_tp_bool": "TypeError",
    "front_devices_int": "TypeError",
    "front_device_bool": "TypeError",
    "front_uid_int": "TypeError",
    "front_cls_none": "TypeError",
    "front_cls_not_tuple": "TypeError",
    "front_plan_units_list": "TypeError",
    "front_plan_unit_devices_int": "TypeError",
    "front_target_pp_float": "TypeError",
}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    """Each case's exception name ("ok": none), or how the child died running it."""
    names, got = list(EXPECTED), {}
    while len(got) < len(names):
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(len(got))],
            capture_output=True,
            text=True,
            timeout=120,
        )
        got |= dict(json.loads(line) for line in proc.stdout.splitlines() if line[:1] == "[")
        if proc.returncode != 0 and len(got) < len(names):
            # The next case killed the child: record it and go on after it.
            got[names[len(got)]] = f"crashed (exit {proc.returncode}): {proc.stderr[-300:]}"
    return got


@pytest.mark.parametrize("case", list(EXPECTED))
def test_binding_raises_instead_of_reading_out_of_bounds(outcomes, case):
    assert outcomes[case] == EXPECTED[case], f"{case}: {outcomes[case]}"
