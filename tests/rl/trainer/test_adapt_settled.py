"""An efficiency trigger alone is answered by a recent search that kept the running plan
(Adapter._settled_row). Planner-only trainer: no worker process is started."""

from __future__ import annotations

from pathlib import Path

from nereus_rl.policy.controller import Trigger
from nereus_rl.trainer.adapt.adapter import SETTLED_STEPS
from nereus_rl.trainer.config import TrainConfig
from nereus_rl.trainer.trainer import Trainer

TRACE = [6, 9, 12, 16, 20, 20, 20, 20, 17, 13]


def _adapter(tmp_path: Path):
    trace = tmp_path / "trace.csv"
    trace.write_text("step,response_len\n" + "".join(f"{i},{n}\n" for i, n in enumerate(TRACE)))
    cfg = TrainConfig(
        algo="grpo", devices=4, warm_steps=20, batch=4, group_size=4, seed=0,
        steps=len(TRACE), trace=str(trace), memory_budget=int(2.442 * 2**20), adapt=True,
    )  # fmt: skip
    return Trainer(cfg, driver=object()).adapter


def _trig(signal: str, step: int) -> Trigger:
    return Trigger(signal, step, 0.7, 1, 0, False, f"{signal} crossed a band")


def test_a_recent_search_answers_an_efficiency_trigger_for_the_same_workload(tmp_path):
    ad = _adapter(tmp_path)
    plan, other = [p for _, p in ad.ranked_plans(16)[:2]]
    wl, wl2 = ad.workload(16), ad.workload(24)
    assert ad._settled_row(3, plan, wl, [_trig("efficiency", 3)]) is None  # no search yet
    ad._settle(2, plan, wl, urgent=False)
    row = ad._settled_row(3, plan, wl, [_trig("efficiency", 3)])
    assert row["reason"].startswith("settled: the search at step 2") and not row["taken"]
    assert row["path"] == "opportunistic" and row["signal"] == "efficiency"
    # each of these searches again
    assert ad._settled_row(3, plan, wl, [_trig("efficiency", 3), _trig("seq_len", 3)]) is None
    assert ad._settled_row(3, plan, wl2, [_trig("efficiency", 3)]) is None  # another bucket
    assert ad._settled_row(3, other, wl, [_trig("efficiency", 3)]) is None  # another plan
    late = 2 + SETTLED_STEPS + 1
    assert ad._settled_row(late, plan, wl, [_trig("efficiency", late)]) is None
    # the running plan's price moved beyond the tie band since the search
    p, w, s, price = ad._settled
    ad._settled = (p, w, s, price / (1.0 + 2 * ad.tie_margin()))
    assert ad._settled_row(3, plan, wl, [_trig("efficiency", 3)]) is None
    # an urgent search, or the replan-always baseline, settles nothing
    ad._settled = None
    ad._settle(2, plan, wl, urgent=True)
    assert ad._settled is None


def test_a_search_answers_an_efficiency_trigger_across_prompt_lengths_of_one_bucket(tmp_path):
    # The bundled tasks lengthen prompts with responses: the workloads of one
    # response-length bucket differ in their prompt length only, and a search that kept
    # the plan for one of them answers an efficiency trigger for another (while the
    # running plan's price stays within the tie band of its price then).
    ad = _adapter(tmp_path)
    plan = ad.ranked_plans(16)[0][1]
    wl16, wl14, wl12 = ad.workload(16), ad.workload(14), ad.workload(12)
    assert wl16.response_len == wl14.response_len and wl16.prompt_len != wl14.prompt_len
    assert wl12.response_len != wl16.response_len  # another bucket
    ad._settle(2, plan, wl16, urgent=False)
    row = ad._settled_row(3, plan, wl14, [_trig("efficiency", 3)])
    assert row is not None and not row["taken"]
    assert "same response bucket (16 -> 14-token prompts)" in row["reason"]
    assert ad._settled_row(3, plan, wl12, [_trig("efficiency", 3)]) is None
    assert ad._settled_row(3, plan, wl14, [_trig("seq_len", 3)]) is None
    # the longer prompt's price against the shorter one's search: settled only within
    # the tie band
    pm = ad.priced()
    ad._settled = None
    ad._settle(2, plan, wl14, urgent=False)
    inside = pm.step_total(plan, wl16) <= pm.step_total(plan, wl14) * (1 + ad.tie_margin())
    assert (ad._settled_row(3, plan, wl16, [_trig("efficiency", 3)]) is not None) == inside
    p, w, s, _ = ad._settled
    ad._settled = (p, w, s, pm.step_total(plan, wl16) / (1.0 + 2 * ad.tie_margin()))
    assert ad._settled_row(3, plan, wl16, [_trig("efficiency", 3)]) is None


def test_a_search_whose_fastest_plan_saves_no_more_than_the_noise_moves_nowhere(tmp_path):
    # Admission declines a saving within the running plan's step noise, and every plan
    # the lookahead could choose is ranked, none faster than the first: so the search
    # stops after the ranking (Adapter._within_noise_row) with the outcome admission
    # would reach, for every candidate.
    ad = _adapter(tmp_path)
    ranked = [p for _, p in ad.ranked_plans(16)]
    plan, fastest, wl = ranked[-1], ranked[0], ad.workload(16)
    pm = ad.priced()
    saving = pm.step_total(plan, wl) - pm.step_total(fastest, wl)
    assert saving > 0
    for r in (0.0, 2 * saving, 4 * saving):  # residuals scattered beyond the saving
        ad.noise.observe(plan, 0.1, 0.1 + r)
    noise = ad.noise.noise_s(plan)
    assert noise > saving
    row = ad._within_noise_row(5, plan, wl, _trig("seq_len", 5), fastest)
    assert row["reason"].startswith("within noise") and not row["taken"]
    assert row["predicted_saving_s"] == saving and row["step_noise_s"] == noise
    assert row["candidate"] == repr(fastest) and row["path"] == "opportunistic"
    # running the fastest plan itself, the next one in the ranking is not faster
    row = ad._within_noise_row(5, fastest, wl, _trig("seq_len", 5), ranked[1])
    assert row["reason"].startswith("not faster") and row["predicted_saving_s"] <= 0
    for c in ranked:  # a free move, paid back over any horizon: declined all the same
        dec = ad.admission.decide(plan, c, wl, forecast_steps=1e6, transition_cost=0.0,
                                  noise_s=noise)  # fmt: skip
        assert not dec.taken, dec.reason
    # a quieter plan (scatter 0.7x the saving, or none): the fastest plan's saving is
    # beyond it, so the search goes on, and admission would take that move
    for d in (0.7 * saving / 1.4826, 0.0):
        ad.noise.obs.clear()
        for r in (0.0, d, 2 * d):
            ad.noise.observe(plan, 0.1, 0.1 + r)
        assert 0 <= ad.noise.noise_s(plan) < saving
        assert ad._within_noise_row(5, plan, wl, _trig("seq_len", 5), fastest) is None
        dec = ad.admission.decide(plan, fastest, wl, forecast_steps=1e6, transition_cost=0.0,
                                  noise_s=ad.noise.noise_s(plan))  # fmt: skip
        assert dec.taken, dec.reason
