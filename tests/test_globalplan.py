import pytest

from nereus_rl.globalplan import GlobalPlan, StagePlan


def _sp(stage, dp, tp, pp, start, model="actor", trains=False):
    n = tp * pp
    units = tuple(tuple(range(start + u * n, start + (u + 1) * n)) for u in range(dp))
    return StagePlan(stage, model, trains, dp, tp, pp, units)


def test_repr_and_groups():
    plan = GlobalPlan(
        (
            _sp("rollout", 2, 2, 1, 0),
            _sp("actor_train", 1, 2, 2, 0, trains=True),
            _sp("reference", 1, 1, 1, 4, model="reference"),
        )
    )
    assert repr(plan.stage("rollout")) == "rollout[dp2 tp2 pp1 @ 0-3]"
    assert plan.colocation_groups() == [("rollout", "actor_train"), ("reference",)]
    assert plan.devices == frozenset(range(5))


def test_bad_units_rejected():
    with pytest.raises(ValueError, match="expected tp\\*pp=4"):
        StagePlan("rollout", "actor", False, 1, 2, 2, ((0, 1),))
    with pytest.raises(ValueError, match="used twice"):
        StagePlan("rollout", "actor", False, 2, 1, 1, ((0,), (0,)))
    with pytest.raises(KeyError, match="stages are"):
        GlobalPlan((_sp("rollout", 1, 1, 1, 0),)).stage("critic_train")


def test_fmt_bytes_picks_a_readable_unit():
    from nereus_rl.globalplan import fmt_bytes

    assert fmt_bytes(100) == "100 B"
    assert fmt_bytes(int(3.61 * 2**20)) == "3.61 MiB"
    assert fmt_bytes(80 * 2**30) == "80.00 GiB"
