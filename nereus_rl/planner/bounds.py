"""Cheap lower bounds of the exact planner (see ``nereus_rl.planner.planner``), for all set
partitions of the stages at once.

``C_G(n)`` is, per phase, the sum over the stages of group ``G`` of the stage's fastest
layout with ``d <= n`` that fits a device alone. A group's choices at any size up to
``n`` are a subset of its stages' choices (joint memory and the width rule only remove
choices), so ``C_G(n)`` bounds its phase times from below; and it only grows as ``n``
shrinks. For a partition ``P`` whose groups get sizes ``n_G`` (powers of two, summing to
at most ``N``), ``sum_p max_G C_{G,p}(n_G)`` therefore bounds every plan with those
sizes, and its minimum over the *maximal* size assignments (no group can double without
exceeding ``N``) bounds every plan of ``P``: any assignment is dominated size by size by
a maximal one, and ``C`` is monotone.

The maximal assignments are few (for six groups: 525 on 32, 1,024 or 4,096 devices,
1,346 on 1,016 or 4,080), so the bound of all 203 partitions of six stages is a handful
of numpy gathers over an index array built once per ``(S, N)``. It is much tighter than
giving every group the largest size the others allow: in bench_planner's calls it
leaves 1 to 13 partitions to search where that bound left 61 to 151.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from nereus_rl.planner.tables import _partitions

# Finite stand-in for "no layout fits" inside the masked sum (inf * 0 would be nan).
_BIG = 1e300


def _maximal_multisets(N: int, k: int) -> list[tuple[int, ...]]:
    """Non-increasing exponent tuples ``(j_1 >= ... >= j_k)`` with ``sum 2^j <= N`` that are
    maximal: doubling the smallest group (the cheapest doubling) would exceed ``N``."""
    out: list[tuple[int, ...]] = []
    top = N.bit_length() - 1

    def rec(pref: list[int], cur: int, left: int, jmax: int) -> None:
        if left == 0:
            if cur + (1 << pref[-1]) > N:
                out.append(tuple(pref))
            return
        for j in range(jmax, -1, -1):
            n = 1 << j
            if cur + n + (left - 1) > N:
                continue
            # All later sizes are <= n: the total can reach at most cur + left * n, and
            # maximality needs total + smallest > N, so cur + (left + 1) * n > N.
            if cur + (left + 1) * n <= N:
                break
            rec([*pref, j], cur + n, left - 1, j)

    rec([], 0, k, top)
    return out


@functools.lru_cache(maxsize=64)
def maximal_assignments(N: int, k: int) -> np.ndarray:
    """Every maximal assignment of power-of-two sizes to ``k`` distinct groups on ``N``
    devices, as an int array ``(m, k)`` of exponents (size ``2**j``); ``(0, k)`` when
    ``k > N``."""
    rows: set[tuple[int, ...]] = set()
    for ms in _maximal_multisets(N, k):
        rows.update(itertools.permutations(ms))
    if not rows:
        return np.zeros((0, k), dtype=np.int64)
    return np.array(sorted(rows), dtype=np.int64).reshape(-1, k)


@functools.lru_cache(maxsize=8)
def _members(S: int) -> np.ndarray:
    """``(2**S, S)``: which stages each subset (bitmask) holds, as 0.0/1.0."""
    return ((np.arange(1 << S)[:, None] >> np.arange(S)[None, :]) & 1).astype(float)


def cheap_table(smin: np.ndarray, phases: list[int]) -> np.ndarray:
    """``C[mask, j, p]``: the cheap bound of every stage subset at size ``2**j``.

    Arguments:
        smin: ``(S, L)`` fastest time of each stage alone at each size (inf: none).
        phases: phase of each stage.

    Returns:
        ``(2**S, L, 3)`` float array, inf where some stage of the subset fits no layout
        up to that size.
    """
    S, L = smin.shape
    per = np.zeros((S, L, 3))
    per[np.arange(S), :, phases] = np.minimum(smin, _BIG)
    C = (_members(S) @ per.reshape(S, L * 3)).reshape(1 << S, L, 3)
    C[C >= _BIG / 2] = np.inf
    return C


class CheapRows(dict):
    """``rows[mask][j] = [c0, c1, c2]``: rows of a cheap table as Python lists, converted
    on first use (the search touches a few subsets; plain floats compare fastest)."""

    def __init__(self, C: np.ndarray) -> None:
        super().__init__()
        self.C = C

    def __missing__(self, mask: int) -> list:
        row = self[mask] = self.C[mask].tolist()
        return row


class PartitionBounds:
    """Index arrays to bound every partition of ``S`` stages on ``N`` devices at once.

    Arguments:
        S: number of stages.
        N: number of devices.

    Attributes:
        parts: the partitions with at most ``N`` groups (tuples of stage-index tuples).
        masks: for each partition, its groups as stage bitmasks.
        L: number of sizes ``1, 2, 4, ..., pow2floor(N)``.
    """

    def __init__(self, S: int, N: int) -> None:
        self.L = L = N.bit_length()
        self.parts = [p for p in _partitions(S) if len(p) <= N]
        self.masks = [tuple(sum(1 << i for i in g) for g in p) for p in self.parts]
        idx, starts = [], []
        r = 0
        for masks in self.masks:
            A = maximal_assignments(N, len(masks))
            # Flat index into C (masks x sizes) per group; unused columns hit mask 0.
            cols = np.zeros((len(A), S), dtype=np.int64)
            cols[:, : len(masks)] = np.array(masks, dtype=np.int64) * L + A
            idx.append(cols)
            starts.append(r)
            r += len(A)
        # Group-major (S, rows): the max over groups is then S-1 elementwise maxima of
        # contiguous rows (numpy reduces a short inner axis slowly).
        self.idx = np.ascontiguousarray(np.concatenate(idx).T)
        self.starts = np.array(starts, dtype=np.int64)

    def partition_bounds(self, C: np.ndarray) -> np.ndarray:
        """Lower bound of every partition in ``parts`` (inf: some group never fits)."""
        by_phase = np.ascontiguousarray(C.transpose(2, 0, 1).reshape(3, -1))
        vals = np.take(by_phase, self.idx, axis=1)  # (3, S, rows)
        top = vals[:, 0].copy()
        for c in range(1, vals.shape[1]):
            np.maximum(top, vals[:, c], out=top)
        return np.minimum.reduceat(top.sum(axis=0), self.starts)


@functools.lru_cache(maxsize=32)
def partition_bounds_of(S: int, N: int) -> PartitionBounds:
    """``PartitionBounds(S, N)``, kept: it depends only on the problem's size, so every
    planner shares it."""
    return PartitionBounds(S, N)
