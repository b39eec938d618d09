"""The size assignments and partition bounds of planner_bounds."""

import itertools

import numpy as np
import pytest

from nereus_rl.planner.bounds import PartitionBounds, cheap_table, maximal_assignments


@pytest.mark.parametrize("N", [1, 2, 3, 5, 7, 12, 24, 32, 40])
def test_maximal_assignments_equal_enumeration(N):
    L = N.bit_length()
    for k in range(1, 7):
        want = set()
        for a in itertools.product(range(L), repeat=k):
            tot = sum(1 << j for j in a)
            if tot <= N and all(tot + (1 << j) > N for j in a):
                want.add(a)
        assert set(map(tuple, maximal_assignments(N, k).tolist())) == want, (N, k)


def test_partition_bounds_equal_direct_minimum():
    """Vectorized bound == min over every assignment with sum <= N (not only maximal)."""
    rng = np.random.default_rng(3)
    S, N = 4, 12
    pb = PartitionBounds(S, N)
    smin = np.sort(rng.uniform(1, 10, (S, pb.L)), axis=1)[:, ::-1].copy()  # falls with n
    smin[2, 0] = np.inf  # stage 2 needs at least 2 devices
    phases = [0, 1, 1, 2]
    C = cheap_table(smin, phases)
    got = pb.partition_bounds(C)
    for part, lb in zip(pb.parts, got):
        best = np.inf
        for js in itertools.product(range(pb.L), repeat=len(part)):
            if sum(1 << j for j in js) > N:
                continue
            M = [0.0, 0.0, 0.0]
            for g, j in zip(part, js):
                v = [0.0, 0.0, 0.0]
                for i in g:
                    v[phases[i]] += smin[i, j]
                M = [max(a, b) for a, b in zip(M, v)]
            best = min(best, sum(M))
        assert lb == pytest.approx(best, rel=1e-12), part
