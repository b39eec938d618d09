"""Where adaptive's time goes against the best fixed plan, step by step (bench_e2e).

Each adaptive run's steps (its plan, step seconds, the transition paid after it) beside
the best fixed plan's mean seconds at the same step over its repeats, and per run the
loss split: the steps before its first move, the moves themselves, the steps after
them (each as seconds over the best fixed plan's at the same steps), and the deciding
at the boundaries beyond the fixed plan's (a fixed plan's boundary only observes). The start plan's
choice (its ``start_choice`` row, when the run logged one) is printed with it.
"""

from __future__ import annotations

from typing import Any


def run_steps(res) -> list[list]:
    """(step, plan index, step_s, transition_s, decision_s) per step of a run: the plan
    index counts the plans the run set (0: its start plan); decision_s is the rest of
    the step's boundary (signals, planner, lookahead, admission), 0 in metrics from
    before it was measured."""
    starts = [s for s, _ in res.plans]
    out = []
    for i, m in enumerate(res.metrics):
        idx = max((k for k, s in enumerate(starts) if s <= i), default=0)
        out.append([i, idx, m["step_s"], m.get("transition_s", 0.0), m.get("decision_s", 0.0)])
    return out


def run_moves(res) -> list[dict[str, Any]]:
    """The run's taken moves and its start-plan choice, with why (decision rows)."""
    keep = ("step", "path", "urgent", "predicted_transition_s", "measured_transition_s")
    out = []
    for d in res.decisions:
        if d.get("signal") == "start_plan" or d.get("taken"):
            row = {k: d.get(k) for k in keep}
            row["reason"] = d.get("reason")
            out.append(row)
    return out


def print_breakdown(algo: str, mode: str, rows: list[dict[str, Any]], best: str) -> dict:
    """Print adaptive's runs step by step against ``best`` (a fixed variant's name) and
    return the loss split (seconds over the run, mean over repeats)."""
    by = {r["variant"]: r for r in rows}
    ad, bf = by["adaptive"], by[best]
    fixed = [s for s in zip(*[[x[2] for x in st] for st in bf["steps_per_repeat"]])]
    ref = [sum(x) / len(x) for x in fixed]
    # the fixed plan's boundaries (observing only), mean per run over its repeats
    ref_dec = sum(sum(x[4] for x in st if len(x) > 4) for st in bf["steps_per_repeat"]) / max(
        1, len(bf["steps_per_repeat"])
    )
    print(f"{algo} {mode}: adaptive step by step vs {best} (mean over its repeats)")
    print("  " + " ".join(f"{x:5.3f}" for x in ref) + f"  {best} (sum {sum(ref):.3f} s)")
    split = {"before_first_move_s": [], "moves_s": [], "after_moves_s": [], "deciding_s": []}
    for rep, (st, mv, plans) in enumerate(
        zip(ad["steps_per_repeat"], ad["moves_per_repeat"], ad["plans_per_repeat"])
    ):
        first = next((x[0] for x in st if x[3] > 0), len(st))
        cells = [f"{x[2]:5.3f}" + (f"+{x[3]:.3f}" if x[3] else "") for x in st]
        print(f"  rep {rep}: " + " ".join(cells) + f"  (sum {sum(x[2] + x[3] for x in st):.3f} s)")
        print(f"    plans: {'; '.join(f'step {s}: {p}' for s, p in plans)}")
        for m in mv:
            tag = "start" if m["path"] == "start" else f"step {m['step']} {m['path']}"
            meas = m["measured_transition_s"]
            print(f"    {tag}: {m['reason']}" + (f" (measured {meas:.3f} s)" if meas else ""))
        split["before_first_move_s"].append(sum(x[2] - r for x, r in zip(st[: first + 1], ref)))
        split["moves_s"].append(sum(x[3] for x in st))
        split["deciding_s"].append(sum(x[4] for x in st if len(x) > 4) - ref_dec)
        split["after_moves_s"].append(
            sum(x[2] - r for x, r in zip(st[first + 1 :], ref[first + 1 :]))
        )
    out = {k: sum(v) / len(v) for k, v in split.items() if v}
    print(
        f"{algo} {mode}: adaptive over {best}, seconds per run (mean of repeats): steps to "
        f"the first move {out.get('before_first_move_s', 0):+.3f}, moves "
        f"{out.get('moves_s', 0):+.3f}, steps after {out.get('after_moves_s', 0):+.3f}, "
        f"deciding {out.get('deciding_s', 0):+.3f}"
    )
    return out
