"""The decision steps of one boundary, as functions of explicit inputs.

The trainer's :class:`~nereus_rl.trainer.adapt.adapter.Adapter` observes a step and,
on a trigger, walks these steps; each returns a :class:`~nereus_rl.policy.decision.Decision`
when it ends the search, or None to go on:

1. :func:`noise_unmeasured`: every opportunistic move is declined until the running
   plan's step noise is measured, so no plan is searched for one.
2. :func:`settled`: an efficiency trigger alone is answered by a recent search that
   kept the running plan (see its docstring).
3. the ranking (the planner's k-best, :func:`search_size` of them), then
   :func:`within_noise`: when the fastest ranked plan saves no more than the noise,
   no move can be admitted, and none is priced.
4. the lookahead over :func:`horizon` lengths chooses among the candidates
   (:func:`opportunistic_pool` on the opportunistic path), :func:`kept_current` when
   it keeps the running plan;
5. admission prices the move (:func:`admitted` turns its verdict into the Decision).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.workload import Workload, bucket_of
from nereus_rl.policy.admission import Verdict
from nereus_rl.policy.controller import Trigger
from nereus_rl.policy.decision import Decision, MovePrice

# Steps a move's lookahead scores (the next step and 5 forecast ones): enough to see
# the next bucket of a rising length without trusting a long trend.
LOOKAHEAD_STEPS = 6
# Plans the planner returns for an urgent decision and for the replan-always baseline:
# a plan that holds the longer lengths may rank low at the next one.
URGENT_RANK = 64
# Plans the planner returns for an opportunistic decision, re-ranked as decisions price
# them: a target must beat the running plan by more than its step noise, which no plan
# far down the ranking does.
OPPORTUNISTIC_RANK = 24
# Of those, the fastest an opportunistic move's lookahead scores over the horizon.
OPPORTUNISTIC_POOL = 12
# Steps a search that kept the running plan answers an efficiency trigger alone for.
SETTLED_STEPS = 3


@dataclass(frozen=True)
class Settled:
    """The last opportunistic search that kept the running plan: the plan, the next
    step's workload then, the step, and the plan's price then (seconds per step)."""

    plan: GlobalPlan
    workload: Workload
    step: int
    price_s: float


def bucket_key(wl: Workload) -> tuple:
    """A workload up to its prompt length: the stages' seq lengths follow the prompt,
    so the stages themselves are not compared."""
    return (wl.algo, wl.batch, wl.response_len, wl.dtype, wl.rollout_ahead, wl.stage_order)


def kept(step: int, trig: Trigger, plan: GlobalPlan, reason: str, **fields: Any) -> Decision:
    """The Decision of an opportunistic trigger answered without a full search (the
    running plan kept, nothing priced); ``fields`` set more of its attributes."""
    return Decision(
        step=step, signal=trig.signal, trigger=trig.reason, urgent=trig.urgent, current=plan,
        taken=False, reason=reason, path="opportunistic", **fields,
    )  # fmt: skip


def noise_unmeasured(
    step: int, trig: Trigger, plan: GlobalPlan, steps_on: int, min_steps: int
) -> Decision:
    """Admission declines every opportunistic move until the running plan's step noise
    is measured (``min_steps`` steps on it; ``steps_on`` so far): searching and pricing
    candidates for one would cost a boundary time that no move can repay."""
    return kept(
        step, trig, plan, "the current plan's step noise is not measured yet "
        f"({steps_on} of {min_steps} steps on it): no opportunistic move before it, so no "
        "plan was searched",
    )  # fmt: skip


def settled(
    step: int,
    plan: GlobalPlan,
    wl: Workload,
    triggers: Sequence[Trigger],
    last: Settled | None,
    price: Callable[[GlobalPlan, Workload], float],
    tie_margin: float,
) -> Decision | None:
    """The Decision of an efficiency trigger that ``last`` search still answers, or None
    to search.

    A step's measured / predicted ratio crosses the efficiency signal's bands often on
    shared cores, and the model already folds each step's measurement into the plans'
    prices, so a search repeated for the same next workload on the same plan, whose
    price (``price(plan, wl)``) has not moved beyond the model's tie band, finds what
    the last one found. So an efficiency trigger alone is answered by a search that
    kept the running plan within the last ``SETTLED_STEPS`` steps, for the same next
    workload up to its prompt length, while the running plan's price is within
    ``tie_margin`` of its price then; any other trigger (a new length bucket, devices,
    memory) searches.

    The prompt length may differ: the bundled tasks lengthen prompts with responses, so
    the workloads of one response-length bucket differ only in it. A longer prompt that
    moves the running plan's price beyond the tie band searches again.
    """
    if last is None or any(t.signal != "efficiency" for t in triggers):
        return None
    if last.plan != plan or step - last.step > SETTLED_STEPS:
        return None
    if last.workload != wl and bucket_key(last.workload) != bucket_key(wl):
        return None
    now = price(plan, wl)
    if now > last.price_s * (1.0 + tie_margin):
        return None
    same = "the same next workload"
    if last.workload != wl:
        same = (
            f"the same response bucket ({last.workload.prompt_len} -> {wl.prompt_len}-token "
            "prompts)"
        )
    return kept(
        step, triggers[0], plan, f"settled: the search at step {last.step} kept the "
        f"current plan for {same}, and its price ({now:.4g} s) is "
        f"within the tie band of its price then ({last.price_s:.4g} s): not searched again",
    )  # fmt: skip


def within_noise(
    step: int,
    plan: GlobalPlan,
    trig: Trigger,
    fastest: GlobalPlan,
    current_s: float,
    fastest_s: float,
    noise_s: float,
) -> Decision | None:
    """The Decision of an opportunistic search whose fastest plan for the next step
    (``fastest``, priced ``fastest_s`` against the running plan's ``current_s``) saves no
    more than the running plan's step noise ``noise_s``, or None.

    Admission declines a saving within that noise, and every plan the lookahead could
    choose is a ranked plan or the running plan, none faster at the next step than
    ``fastest``: no move can be taken, so the lookahead and the move's pricing are not
    run; the outcome is the one they would reach.
    """
    saving = current_s - fastest_s
    if saving > noise_s:
        return None
    if saving <= 0:
        why = (
            f"not faster: the ranking's fastest plan for the next step prices "
            f"{fastest_s:.4g} s/step against the current plan's {current_s:.4g} s"
        )
    else:
        why = (
            f"within noise: the fastest plan for the next step saves {saving:.3g} s/step, "
            f"within the measured step noise ({noise_s:.3g} s per step on the current plan)"
        )
    return kept(
        step, trig, plan, why + ", so admission takes no candidate: none was looked "
        "ahead to or priced for a move",
        candidate=fastest, predicted_saving_s=saving, step_noise_s=noise_s,
    )  # fmt: skip


def search_size(urgent: bool, replan_always: bool) -> int:
    """Plans to ask the planner for: urgent moves and the replan-always baseline keep
    the whole k-best; an opportunistic move asks for fewer (each is re-priced)."""
    return URGENT_RANK if urgent or replan_always else OPPORTUNISTIC_RANK


def horizon(
    rlen: int,
    steps_left: int | None,
    buckets: Sequence[int],
    forecast_lengths: Callable[[int], Sequence[int]],
) -> tuple[int, ...]:
    """The lengths a move's lookahead scores over: ``rlen`` (bucketed), then the
    seq_len signal's forecast (``forecast_lengths(n)``: its next ``n`` lengths),
    ``LOOKAHEAD_STEPS`` in all or the ``steps_left`` the run has if fewer.

    Raises:
        SignalError: the signal cannot forecast yet.
    """
    n = LOOKAHEAD_STEPS if steps_left is None else max(1, min(LOOKAHEAD_STEPS, steps_left))
    return (bucket_of(rlen, buckets), *forecast_lengths(n - 1))


def opportunistic_pool(ranked: Sequence[GlobalPlan], plan: GlobalPlan) -> list[GlobalPlan]:
    """The candidates an opportunistic move's lookahead scores: the ``OPPORTUNISTIC_POOL``
    fastest for the next step and the running plan (at no transition cost), so that a
    plan faster for the next step only is not moved to."""
    pool = list(ranked[:OPPORTUNISTIC_POOL])
    return pool if plan in pool else [*pool, plan]


def kept_current(
    step: int,
    trig: Trigger,
    plan: GlobalPlan,
    best: GlobalPlan,
    lookahead_reason: str | None,
    **fields: Any,
) -> Decision:
    """The Decision of a search whose choice is the running plan: the planner's best
    (``best``) is the running plan, or the lookahead kept it (``lookahead_reason``)."""
    why = "the planner's best plan is the current one"
    if best != plan:
        why = f"lookahead keeps the current plan: {lookahead_reason}"
    return kept(step, trig, plan, why, candidate=plan, **fields)


def admitted(
    step: int,
    trig: Trigger,
    plan: GlobalPlan,
    verdict: Verdict,
    move: MovePrice,
    cost_s: float,
    replan_always: bool,
    **fields: Any,
) -> Decision:
    """The Decision of a priced move: admission's ``verdict`` on it, the move priced at
    ``cost_s`` (``move`` says from what). The replan-on-every-trigger baseline takes
    every move admission declines ("replan on every trigger")."""
    taken = verdict.taken or replan_always
    return Decision(
        step=step, signal=trig.signal, trigger=trig.reason, urgent=trig.urgent, current=plan,
        taken=taken, path=verdict.path,
        reason=verdict.reason if verdict.taken or not replan_always else "replan on every trigger",
        candidate=verdict.candidate, predicted_saving_s=verdict.saving_per_step_s,
        predicted_transition_s=cost_s, move=move, **fields,
    )  # fmt: skip


def no_plan_fits(step: int, trig: Trigger, plan: GlobalPlan, error: Exception) -> Decision:
    """The Decision of a search where no plan fits: the running plan goes on."""
    return Decision(
        step=step, signal=trig.signal, trigger=trig.reason, urgent=trig.urgent, current=plan,
        taken=False, reason=str(error), predicted_saving_s=None, predicted_transition_s=None,
    )  # fmt: skip


def search_fields(
    ranked: Sequence[tuple[float, GlobalPlan]],
    model: Mapping[str, Any],
    lookahead: Mapping[str, Any] | None,
    lookahead_note: str | None,
) -> dict[str, Any]:
    """The Decision attributes every decision of a full search carries: the ranked
    candidates, the model that ranked them, the lookahead's record or why it did not
    run."""
    return dict(
        candidates=tuple((p, s) for s, p in ranked),
        model=dict(model),
        lookahead=lookahead,
        lookahead_note=lookahead_note,
    )
