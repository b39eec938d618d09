"""An efficiency trigger alone is answered by a recent search that kept the running plan
(policy.decide.settled), and a search whose fastest plan saves no more than the step
noise moves nowhere (policy.decide.within_noise). Planner-only trainer: no worker
process is started."""

from __future__ import annotations

from pathlib import Path

from nereus_rl.policy import decide
from nereus_rl.policy.controller import Trigger
from nereus_rl.policy.decide import SETTLED_STEPS, Settled
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


def _settled(ad, step, plan, wl, triggers, last):
    return decide.settled(step, plan, wl, triggers, last, ad.priced().step_total, ad.tie_margin())


def _search(ad, step, plan, wl) -> Settled:
    return Settled(plan, wl, step, ad.priced().step_total(plan, wl))


def test_a_recent_search_answers_an_efficiency_trigger_for_the_same_workload(tmp_path):
    ad = _adapter(tmp_path)
    plan, other = [p for _, p in ad.ranked_plans(16)[:2]]
    wl, wl2 = ad.workload(16), ad.workload(24)
    assert _settled(ad, 3, plan, wl, [_trig("efficiency", 3)], None) is None  # no search yet
    last = _search(ad, 2, plan, wl)
    d = _settled(ad, 3, plan, wl, [_trig("efficiency", 3)], last)
    assert d.reason.startswith("settled: the search at step 2") and not d.taken
    row = d.to_row()
    assert row["path"] == "opportunistic" and row["signal"] == "efficiency"
    assert row["predicted_saving_s"] == 0.0 and "candidate" not in row
    # each of these searches again
    both = [_trig("efficiency", 3), _trig("seq_len", 3)]
    assert _settled(ad, 3, plan, wl, both, last) is None
    assert _settled(ad, 3, plan, wl2, [_trig("efficiency", 3)], last) is None  # another bucket
    assert _settled(ad, 3, other, wl, [_trig("efficiency", 3)], last) is None  # another plan
    late = 2 + SETTLED_STEPS + 1
    assert _settled(ad, late, plan, wl, [_trig("efficiency", late)], last) is None
    # the running plan's price moved beyond the tie band since the search
    moved = Settled(plan, wl, 2, last.price_s / (1.0 + 2 * ad.tie_margin()))
    assert _settled(ad, 3, plan, wl, [_trig("efficiency", 3)], moved) is None


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
    last = _search(ad, 2, plan, wl16)
    d = _settled(ad, 3, plan, wl14, [_trig("efficiency", 3)], last)
    assert d is not None and not d.taken
    assert "same response bucket (16 -> 14-token prompts)" in d.reason
    assert _settled(ad, 3, plan, wl12, [_trig("efficiency", 3)], last) is None
    assert _settled(ad, 3, plan, wl14, [_trig("seq_len", 3)], last) is None
    # the longer prompt's price against the shorter one's search: settled only within
    # the tie band
    pm = ad.priced()
    last = _search(ad, 2, plan, wl14)
    inside = pm.step_total(plan, wl16) <= pm.step_total(plan, wl14) * (1 + ad.tie_margin())
    assert (_settled(ad, 3, plan, wl16, [_trig("efficiency", 3)], last) is not None) == inside
    low = Settled(plan, wl14, 2, pm.step_total(plan, wl16) / (1.0 + 2 * ad.tie_margin()))
    assert _settled(ad, 3, plan, wl16, [_trig("efficiency", 3)], low) is None


def _within_noise(ad, plan, wl, fastest, trig):
    pm = ad.priced()
    return decide.within_noise(
        5, plan, trig, fastest, pm.step_total(plan, wl), pm.step_total(fastest, wl),
        ad.noise.noise_s(plan),
    )  # fmt: skip


def test_a_search_whose_fastest_plan_saves_no_more_than_the_noise_moves_nowhere(tmp_path):
    # Admission declines a saving within the running plan's step noise, and every plan
    # the lookahead could choose is ranked, none faster than the first: so the search
    # stops after the ranking with the outcome admission would reach, for every
    # candidate.
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
    row = _within_noise(ad, plan, wl, fastest, _trig("seq_len", 5)).to_row()
    assert row["reason"].startswith("within noise") and not row["taken"]
    assert row["predicted_saving_s"] == saving and row["step_noise_s"] == noise
    assert row["candidate"] == repr(fastest) and row["path"] == "opportunistic"
    # running the fastest plan itself, the next one in the ranking is not faster
    d = _within_noise(ad, fastest, wl, ranked[1], _trig("seq_len", 5))
    assert d.reason.startswith("not faster") and d.predicted_saving_s <= 0
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
        assert _within_noise(ad, plan, wl, fastest, _trig("seq_len", 5)) is None
        dec = ad.admission.decide(plan, fastest, wl, forecast_steps=1e6, transition_cost=0.0,
                                  noise_s=ad.noise.noise_s(plan))  # fmt: skip
        assert dec.taken, dec.reason


def test_the_adapter_settles_only_after_an_opportunistic_search_that_kept_the_plan(tmp_path):
    # An urgent search, or the replan-always baseline, settles nothing: Adapter.decide
    # records the search only where decide.settled may answer from it.
    ad = _adapter(tmp_path)
    assert ad.settled is None
    plan = ad.ranked_plans(16)[0][1]
    assert decide.search_size(True, False) == decide.search_size(False, True) == 64
    assert decide.search_size(False, False) == decide.OPPORTUNISTIC_RANK
    pool = decide.opportunistic_pool([p for _, p in ad.ranked_plans(16)], plan)
    assert plan in pool and len(pool) <= decide.OPPORTUNISTIC_POOL + 1
