"""The compiled search of the exact planner (``nereus_rl._native``; see :mod:`.planner`).

The C++ code (csrc/rl/planner/) runs steps 1 to 3 of the planner's algorithm (Pareto
lists, cheap and partition bounds, group tables, the branch and bound with its k best)
over flat arrays, following the Python modules step by step, so that it returns the same
plans, objectives (bit for bit), k-best order and tie-breaks. What stays here:

* pricing the stage tables: one numpy product of their stacked work matrices with the
  inverse efficiencies (``Planner._stack``, :func:`price`; the Python search prices from
  the same product), once per (stage shapes, efficiency version, capacity);
* nothing else: the index of the set partitions and their maximal size assignments per
  (stages, devices) is built in C++ (``partition_index_of``; ``partition_index``
  marshals the Python ``planner_bounds`` one, which the reference search uses).

A :class:`NativeContext` holds one compiled context; its caches (group tables,
partition bounds per device count) survive across calls, like the Python planner's.
"""

from __future__ import annotations

import functools

import numpy as np

from nereus_rl.planner.bounds import PartitionBounds
from nereus_rl.planner.tables import _StageTable

try:
    from nereus_rl import _native
except ImportError:  # a source checkout without the built module
    _native = None

#: Whether the compiled search is there (``nereus_rl._native`` built with the planner).
AVAILABLE = _native is not None and hasattr(_native, "PlanContext")


def price(W: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The stacked tables' times ``W @ x`` (``W``: ``Planner._stack``'s matrix, in Fortran
    order, for which numpy's product is the cheaper of the two here; ``x``: the inverse
    efficiencies). Both searches price from this one product, so they see the same times
    (a row's product can differ in the last bit with the matrix's order and shape)."""
    return W @ x


@functools.lru_cache(maxsize=32)
def partition_index(pb: PartitionBounds, N: int):
    """The compiled copy of ``pb``'s index arrays (``pb`` is itself cached per (S, N))."""
    return _native.PartitionIndex(pb.idx, pb.starts, [list(m) for m in pb.masks], N)


@functools.lru_cache(maxsize=32)
def partition_index_of(S: int, N: int):
    """The compiled index of ``S`` stages on ``N`` devices, built in C++: the same as
    ``partition_index(PartitionBounds(S, N), N)`` (tests check every array), in tens of
    microseconds where building ``PartitionBounds`` takes milliseconds, on the first
    decision at each new device count (e.g. the first one after a loss). Built modules without
    it fall back to that."""
    build = getattr(_native.PartitionIndex, "build", None)
    if build is None:
        from nereus_rl.planner.bounds import partition_bounds_of

        return partition_index(partition_bounds_of(S, N), N)
    return build(S, N)


def make_context(
    times: np.ndarray,
    tables: list[_StageTable],
    phases: list[int],
    r_i: int,
    a_i: int,
    cap: int,
    max_n: int,
    dpn: int,
    one_node: bool,
):
    """A compiled search context for stage tables priced as ``times``.

    Arguments:
        times: every stage's layout times one block after the other (the rollout's with
            its intra-node weight sync), then the rollout's with the inter-node sync
            (``Planner._stack``'s matrix times the inverse efficiencies).
        tables: the stage tables, in the workload's stage order.
        phases: each stage's phase.
        r_i, a_i: index of rollout and actor_train (-1: absent).
        cap: usable bytes per device.
        max_n: the cluster's device count (the sizes tabled are the powers of two up to it).
        dpn: devices per node.
        one_node: whether the cluster is one node.

    Returns:
        ``_native.PlanContext``.
    """
    return _native.PlanContext(
        times, stage_layouts(tables), phases, r_i, a_i, cap, max_n, dpn, one_node
    )


def make_context_of(times, layouts: list, phases, r_i, a_i, cap, max_n, dpn, one_node):
    """:func:`make_context` with the tables' compiled layouts given (``stage_layouts``,
    kept by the caller per stage shapes)."""
    return _native.PlanContext(times, layouts, phases, r_i, a_i, cap, max_n, dpn, one_node)


def stage_layouts(tables: list[_StageTable]) -> list:
    """Each table's compiled copy of its layouts' memory and device counts
    (``_native.StageLayouts``), marshalled once per table and kept on it: they depend
    only on the table, so ``Planner.prepare`` builds them with the tables."""
    layouts = []
    for t in tables:
        lay = t.__dict__.get("_native")
        if lay is None:
            lay = t._native = _native.StageLayouts(t.mem, t.d)
        layouts.append(lay)
    return layouts
