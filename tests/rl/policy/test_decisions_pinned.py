"""The adaptation loop's decisions on recorded boundary signals, pinned.

Each case of ``decisions_pinned.json`` is a run's configuration (a small GRPO job on 4
CPU devices, a length trace, a memory budget, a first plan) and the signals of its
boundaries: each step's metrics (response length, step and stage seconds), the devices
lost before it, and the seconds a taken move lasts. The test replays them through the
trainer's decision side (``Adapter.boundary``) with a stand-in for the trainer's process
side (a move sets the plan and advances a fake clock; no worker process is started) and
compares every decisions.jsonl row, its keys and values, with the recorded ones.

The cases cover the urgent path (memory over budget, lost devices), opportunistic moves
admitted and declined by payback, declines before any search (noise not measured,
settled, within noise), the start plan's row, the replan-on-every-trigger baseline and
a move cut short by a worker death.

To re-record after an intended change of the decisions (say why in the commit):
``PYTHONPATH=. python tests/rl/policy/test_decisions_pinned.py --record``.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from nereus_rl.runtime import WorkerLostError
from nereus_rl.trainer.config import TrainConfig
from nereus_rl.trainer.report import _plain
from nereus_rl.trainer.trainer import Trainer

GOLDEN = pathlib.Path(__file__).with_name("decisions_pinned.json")

RISE = [6, 9, 12, 16, 20, 20, 20, 20, 17, 13]
LONG = [6, 9, 12, 16, 20, 20, 20, 20, 24, 28, 32, 32, 32, 28, 24, 20, 16, 16, 16, 12]

# name -> (config, trace, {step: devices lost before it}, seconds a move lasts,
#          every third step's measured/priced factor, (step, factor): the plan running at
#          that step measures this much slower from then on)
SCENARIOS: dict[str, tuple[dict[str, Any], list[int], dict[int, list[int]], float, float, Any]] = {
    "moves": (dict(plan="colocated", budget_mib=4.0), LONG, {16: [3]}, 3.0, 1.0, None),
    "lean": (dict(plan="colocated", budget_mib=6.0), LONG, {12: [3]}, 3.0, 1.0, None),
    "memory": (dict(plan="colocated", budget_mib=2.442), LONG, {14: [3]}, 3.0, 1.0, (4, 2.5)),
    "noisy": (dict(plan="colocated", budget_mib=2.442), RISE, {}, 0.5, 1.3, (4, 2.5)),
    "start": (dict(plan="auto", budget_mib=2.442), RISE, {}, 0.5, 1.3, None),
    "always": (
        dict(plan="colocated", budget_mib=4.0, admission="always"),
        RISE,
        {7: [3]},
        0.5,
        1.3,
        None,
    ),
    "async": (dict(plan="auto", budget_mib=2.442, mode="async"), LONG, {}, 0.5, 1.3, None),
    # the first move is cut short by a worker death (the replay ends there)
    "cut": (dict(plan="colocated", budget_mib=2.442), RISE, {}, 0.5, 1.0, None),
}
# scenario -> the worker a death during its first move names
CUT = {"cut": 2}


def _trainer(case: dict[str, Any], tmp: pathlib.Path) -> Trainer:
    trace = tmp / f"{case['name']}.csv"
    lengths = case["trace"]
    trace.write_text("step,response_len\n" + "".join(f"{i},{n}\n" for i, n in enumerate(lengths)))
    c = dict(case["config"])
    cfg = TrainConfig(
        algo="grpo", devices=4, warm_steps=20, batch=4, group_size=4, seed=0,
        steps=len(lengths), trace=str(trace), memory_budget=int(c.pop("budget_mib") * 2**20),
        adapt=True, **c,
    )  # fmt: skip
    return Trainer(cfg, driver=object())  # a driver is given: nothing is spawned


class _Clock:
    """time.perf_counter for the replay: still, except while a move runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stand_in(tr: Trainer, clock: _Clock, move_s: float, cut: int | None = None) -> None:
    """The trainer's process side as the decision side uses it: a move sets the plan
    (as Trainer.transition does) and lasts ``move_s`` on the fake clock; with ``cut``,
    worker ``cut`` dies half-way through it instead."""
    tr.plan = tr.first_plan
    tr.group.attach(range(tr.cfg.devices))  # plan device d is worker d
    tr.finish_ahead = lambda: None

    def transition(new, dag, step):
        if cut is not None:
            clock.now += move_s / 2
            raise WorkerLostError(f"worker {cut} died during a transition\ntraceback", (cut,))
        tr.plan = new
        tr.result.plans.append((step, new))
        clock.now += move_s
        prims = [f"{p.kind}:{p.stage}" for p in dag.primitives] if dag is not None else []
        return SimpleNamespace(
            primitives=prims, fallback_stages={}, bytes_moved=1000 * len(prims),
            fallback_bytes=0, primitive_s=0.9 * move_s, rebind_s=0.05 * move_s,
            fallback_s=0.0, execution=None,
        )  # fmt: skip

    tr.transition = transition


def _replay(case: dict[str, Any], tmp: pathlib.Path, clock: _Clock, record: bool = False):
    """Drive every recorded boundary; returns the decision rows as decisions.jsonl holds
    them (and, with ``record``, fills ``case["steps"]`` with the metrics it made up)."""
    tr = _trainer(case, tmp)
    _stand_in(tr, clock, case["move_s"], CUT.get(case["name"]))
    ad = tr.adapter
    slow_at, slow_plan = case.get("slow"), None
    steps = []
    for step in range(tr.cfg.steps):
        lost = case["lost"].get(str(step), [])
        if lost:
            tr.group.rebase({d: w for d, w in tr.device_worker.items() if d not in lost})
        if record:
            # the model's price of the running plan, scaled as the scenario says
            rlen = tr.lengths.response_len(step)
            est = ad.priced().stage_price(tr.plan, ad.workload(rlen))
            secs = {k: v.seconds for k, v in est.stages.items()}
            if slow_at is not None and step == slow_at[0]:
                slow_plan = tr.plan
            f = slow_at[1] if slow_plan is not None and tr.plan == slow_plan else 1.0
            f *= case["jitter"] if step % 3 == 2 else 1.0
            m = {
                "response_len": int(rlen),
                "step_s": f * sum(secs.values()),
                "stage_s": {
                    "rollout": f * secs["rollout"],
                    "inference": f * secs["reference"],
                    "train": f * secs["actor_train"],
                },
            }
            steps.append(m)
        else:
            m = json.loads(json.dumps(case["steps"][step]))
        try:
            ad.boundary(step, m)
        except WorkerLostError:  # the trainer's recovery would go on from here
            assert case["name"] in CUT
            break
    if record:
        case["steps"] = steps
    return [json.loads(json.dumps(_plain(r))) for r in tr.result.decisions]


def _close(a: Any, b: Any, where: str) -> None:
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), where
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _golden() -> list[dict[str, Any]]:
    return json.loads(GOLDEN.read_text())


def test_recorded_cases_cover_every_path():
    rows = [r for c in _golden() for r in c["rows"]]
    paths = {(r.get("path"), r["urgent"], r["taken"]) for r in rows}
    assert ("urgent", True, True) in paths
    assert ("opportunistic", False, True) in paths
    assert ("start", False, False) in paths
    assert any(r.get("interrupted") is True and r["lost_workers"] == [2] for r in rows)
    signals = {r["signal"] for r in rows if r.get("path") == "urgent"}
    assert {"memory", "devices"} <= signals
    reasons = [r["reason"] for r in rows if not r["taken"]]
    for start in ("saves ", "settled: ", "within noise: ", "not faster: ", "lookahead keeps",
                  "the current plan's step noise is not measured yet"):  # fmt: skip
        assert any(x.startswith(start) for x in reasons), start
    assert any(r["reason"] == "replan on every trigger" for r in rows) or any(
        c["name"] == "always" and any(r["taken"] for r in c["rows"]) for c in _golden()
    )


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_decisions_match_the_recorded_rows(name, tmp_path, monkeypatch):
    case = next(c for c in _golden() if c["name"] == name)
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    rows = _replay(case, tmp_path, clock)
    want = case["rows"]
    assert len(rows) == len(want), [(r["step"], r["reason"]) for r in rows]
    for i, (got, exp) in enumerate(zip(rows, want)):
        _close(got, exp, f"{name} row {i} (step {exp['step']})")


def _record(tmp: pathlib.Path) -> list[dict[str, Any]]:
    cases = []
    for name, (config, trace, lost, move_s, jitter, slow) in SCENARIOS.items():
        case = {
            "name": name, "config": config, "trace": trace,
            "lost": {str(k): v for k, v in lost.items()}, "move_s": move_s, "jitter": jitter,
            "slow": slow,
        }  # fmt: skip
        clock = _Clock()
        saved, time.perf_counter = time.perf_counter, clock
        try:
            case["rows"] = _replay(case, tmp, clock, record=True)
        finally:
            time.perf_counter = saved
        cases.append(case)
    return cases


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/rl/policy/test_decisions_pinned.py --record")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cases = _record(pathlib.Path(d))
    GOLDEN.write_text(json.dumps(cases, indent=1) + "\n")
    for c in cases:
        print(c["name"], [(r["step"], r.get("path"), r["taken"]) for r in c["rows"]])
    print(f"recorded {len(cases)} cases to {GOLDEN}")
