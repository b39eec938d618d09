import pytest

from nereus_rl.core.globalplan import GlobalPlan, StagePlan


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
    from nereus_rl.core.globalplan import fmt_bytes

    assert fmt_bytes(100) == "100 B"
    assert fmt_bytes(int(3.61 * 2**20)) == "3.61 MiB"
    assert fmt_bytes(80 * 2**30) == "80.00 GiB"


def test_a_pickled_plan_hashes_anew_in_a_process_with_other_string_hashing():
    # Plans and workloads keep their hash once computed (the cost model's caches are
    # keyed by them); that hash is of this process's string hashing, so it must not
    # travel: an equal plan built in another process must find the pickled one.
    import pickle
    import subprocess
    import sys

    from nereus_rl.core.spec import model_preset
    from nereus_rl.core.workload import make_workload

    a = StagePlan("rollout", "actor", False, 1, 1, 1, ((0,),))
    plan = GlobalPlan((a,))
    wl = make_workload("grpo", actor=model_preset("tiny"), batch=4, prompt_len=8,
                       response_len=8, group_size=2, micro_batch=2, dtype="fp32")  # fmt: skip
    hash(plan), hash(a), hash(wl)
    code = (
        "import pickle, sys\n"
        "from nereus_rl.core.globalplan import GlobalPlan, StagePlan\n"
        "from nereus_rl.core.workload import make_workload\n"
        "from nereus_rl.core.spec import model_preset\n"
        "plan, wl = pickle.loads(sys.stdin.buffer.read())\n"
        "a = StagePlan('rollout', 'actor', False, 1, 1, 1, ((0,),))\n"
        "w = make_workload('grpo', actor=model_preset('tiny'), batch=4, prompt_len=8,"
        " response_len=8, group_size=2, micro_batch=2, dtype='fp32')\n"
        "print({GlobalPlan((a,)): 1}.get(plan), {a: 1}.get(plan.stages[0]), {w: 1}.get(wl))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps((plan, wl)), capture_output=True,
        env={**__import__("os").environ, "PYTHONHASHSEED": "12345"}, check=True,
    )  # fmt: skip
    assert out.stdout.split() == [b"1", b"1", b"1"], out.stderr
