"""A transition cut short by a worker death has a decision row of its own; and
admission's forecast never counts steps past the run's end.

The adaptive run (started on the colocated plan, which it leaves at its first
boundary) loses a worker inside the first live primitive of its first transition.
The decision that took the move must still be in the log, taken, marked
``interrupted`` with the cause, beside the recovery's own row; before, the row went
down with the exception and the log showed the recovery only.
"""

from __future__ import annotations

import json
import threading

from nereus_rl.report import RunLog
from nereus_rl.runtime import Driver
from nereus_rl.trainer import TrainConfig, Trainer

FAST = {"warm_steps": 30, "batch": 4, "group_size": 2}


def test_a_transition_cut_by_a_death_logs_its_decision_interrupted(tmp_path):
    d = Driver(heartbeat_timeout=60.0, call_timeout=300.0)
    d.spawn_local(4, method="forkserver")
    try:
        cfg = TrainConfig(
            algo="grpo", steps=3, seed=3, length_start=6, length_end=14, plan="colocated",
            **FAST,
        )  # fmt: skip
        tr = Trainer(cfg, driver=d, log=RunLog(tmp_path, cfg))
        tr.start()
        killed: list[int] = []
        run_one = tr.units._run
        once = threading.Lock()  # the executor runs ready primitives from several threads

        def kill_then_run(p, live):
            with once:
                if not killed:
                    killed.append(3)
                    d.kill(tr.device_worker[3])
            run_one(p, live)

        tr.units._run = kill_then_run
        res = tr.run()
        tr.close()
    finally:
        d.shutdown()
    assert res.error is None, res.error
    assert killed == [3], "no live primitive ran: the run made no transition"
    # (the recovery's row names what was cut short in its own "interrupted", a string)
    cut = [r for r in res.decisions if r.get("interrupted") is True]
    assert len(cut) == 1, res.decisions
    row = cut[0]
    assert row["taken"] and row["step"] == 0, row
    assert row["measured_transition_s"] > 0 and row["cause"], row
    assert "Worker" in row["cause"] or "worker" in row["cause"], row
    # the recovery's row follows it, for the same loss
    rec = [r for r in res.decisions if "lost devices" in str(r.get("trigger"))]
    assert len(rec) == 1 and res.decisions.index(rec[0]) > res.decisions.index(row)
    # both are in the run folder's decision log, in that order
    rows = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [r.get("interrupted") for r in rows if r.get("taken")][:1] == [True], rows
    assert any("lost devices" in str(r.get("trigger")) for r in rows), rows
    # admission counts savings no further than the run goes (3 steps: 2 after step 0)
    priced = [r for r in res.decisions if "forecast_steps" in r]
    assert priced, res.decisions
    for r in priced:
        assert r["steps_left"] == cfg.steps - r["step"] - 1, r
        assert r["forecast_steps"] <= r["steps_left"] <= 2, r
