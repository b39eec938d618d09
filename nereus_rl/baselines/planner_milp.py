"""The planner's problem as a MILP for OR-Tools: SCIP (pywraplp) and CP-SAT baselines.

Same plan space, objective and candidate tables as ``nereus_rl.planner.planner`` (the
planner's stage tables: every layout of every stage that fits a device, with its time
from the cost model; rollout once per sync tier). Variables:

    x_G in {0,1}     group G (any non-empty subset of stages) is a colocation group
    y_{s,l} in {0,1} stage s uses layout l (d_l devices, t_{s,l} seconds, m_{s,l} bytes)
    n_G >= 0         devices of group G;   c in {0,1}: the weight sync is intra-node
    v_l = y_{rollout,l} * c (linearized);  C_p >= 0: the time of phase p

    min  sum_p C_p
    s.t. sum_{G ∋ s} x_G = 1                              every stage in one group
         sum_l y_{s,l} = 1                                one layout per stage
         n_G >= sum_l d_l y_{s,l} - N (1 - x_G)            s in G; n_G <= N x_G
         sum_G n_G <= N
         sum_{s in G} sum_l m_{s,l} y_{s,l} <= cap + M_G (1 - x_G)
         c <= sum_{G ∋ rollout, actor_train} x_G ;  n_G <= dpn + N (1 - c) for those G
         t_s = sum_l t_{s,l} y_{s,l}  (rollout: inter-tier times minus the intra saving
               on v)
         C_p >= sum_{s in G, phase p} t_s - T (1 - x_G)    every G, p

The sync saving is taken when it exists, which relies on intra-node syncs being no
slower than inter-node ones (true unless measurements make the intra tier's efficiency
absurdly low; checked, and the model refuses otherwise). CP-SAT needs integers: times
are rounded to microseconds and memory kept in bytes, so its optimum matches SCIP's to
within a microsecond per stage.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp
from ortools.sat.python import cp_model

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.spec import ClusterSpec
from nereus_rl.core.workload import Workload
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.planner.place import place
from nereus_rl.planner.planner import Planner


@dataclass(frozen=True)
class MilpResult:
    """A solver's answer: objective (seconds), whether optimality is proven, the plan."""

    solver: str
    objective_s: float | None
    proven: bool
    status: str
    solve_ms: float
    plan: GlobalPlan | None
    num_vars: int

    def __repr__(self) -> str:
        obj = "none" if self.objective_s is None else f"{self.objective_s:.6g}s"
        return f"MilpResult({self.solver}: {obj}, {self.status}, {self.solve_ms:.1f} ms)"


class _Tables:
    def __init__(self, workload, cluster, costmodel, devices):
        self.planner = Planner(cluster, costmodel)
        self.devs = sorted(set(range(cluster.num_devices) if devices is None else devices))
        self.N = len(self.devs)
        self.cap = costmodel.capacity_bytes
        self.stages = list(workload.planned_stages)
        actor = workload.stage("actor_train").model_spec
        x = costmodel.inverse_efficiencies
        self.tables, self.cands, self.t, self.tintra = [], [], [], None
        for s in self.stages:
            tab = self.planner._table(s, actor if s.stage == "rollout" else None, workload.dtype)
            self.tables.append(tab)
            ok = np.nonzero((tab.mem <= self.cap) & (tab.d <= self.N))[0]
            self.cands.append([int(i) for i in ok])
            if s.stage == "rollout":
                self.t.append((tab.W + tab.sync["inter"]) @ x)
                self.tintra = (tab.W + tab.sync["intra"]) @ x
            else:
                self.t.append(tab.W @ x)
        names = [s.stage for s in self.stages]
        self.r = names.index("rollout")
        self.a = names.index("actor_train")
        S = len(self.stages)
        self.groups = [g for k in range(1, S + 1) for g in itertools.combinations(range(S), k)]
        self.dpn = cluster.devices_per_node
        self.one_node = cluster.num_nodes == 1
        if self.one_node:
            self.t[self.r] = self.tintra
        delta = self.t[self.r] - self.tintra
        if (delta < -1e-12).any():
            raise ValueError(
                "intra-node weight sync predicted slower than inter-node; the MILP "
                "formulation assumes otherwise (check the efficiencies)"
            )

    def build(self, workload, groups, choice) -> GlobalPlan:
        picks = [(g, tuple(choice[i] for i in g)) for g in groups]
        return place(self.stages, self.tables, picks, self.devs)


def _empty(solver, name, start, status):
    return MilpResult(name, None, False, status, (time.perf_counter() - start) * 1e3, None, 0)


def solve_scip(
    workload: Workload,
    cluster: ClusterSpec,
    costmodel: CostModel,
    *,
    devices: Iterable[int] | None = None,
    time_limit_s: float = 60.0,
) -> MilpResult:
    """Solve the planning MILP with SCIP (pywraplp).

    Returns:
        MilpResult; ``proven`` is True only when SCIP reports OPTIMAL.
    """
    start = time.perf_counter()
    T = _Tables(workload, cluster, costmodel, devices)
    solver = pywraplp.Solver.CreateSolver("SCIP")
    solver.SetTimeLimit(int(time_limit_s * 1000))
    S, N = len(T.stages), T.N
    x = {g: solver.BoolVar(f"x{g}") for g in T.groups}
    n = {g: solver.NumVar(0, N, f"n{g}") for g in T.groups}
    y = [{li: solver.BoolVar(f"y{s}_{li}") for li in T.cands[s]} for s in range(S)]
    if any(not ys for ys in y):
        return _empty(solver, "scip", start, "infeasible (a stage fits no layout)")
    for s in range(S):
        solver.Add(sum(x[g] for g in T.groups if s in g) == 1)
        solver.Add(sum(y[s].values()) == 1)
    tab = T.tables
    for g in T.groups:
        for s in g:
            solver.Add(
                n[g] >= sum(int(tab[s].d[li]) * v for li, v in y[s].items()) - N * (1 - x[g])
            )
        solver.Add(n[g] <= N * x[g])
        big = sum(max(int(tab[s].mem[li]) for li in T.cands[s]) for s in g)
        # Memory in GiB keeps SCIP's absolute tolerances meaningful.
        solver.Add(
            sum(float(tab[s].mem[li]) / 2**30 * v for s in g for li, v in y[s].items())
            <= T.cap / 2**30 + big / 2**30 * (1 - x[g])
        )
    solver.Add(sum(n.values()) <= N)
    ts = []
    for s in range(S):
        ts.append(sum(float(T.t[s][li]) * v for li, v in y[s].items()))
    if not T.one_node:
        c = solver.BoolVar("c")
        both = [g for g in T.groups if T.r in g and T.a in g]
        solver.Add(c <= sum(x[g] for g in both))
        for g in both:
            solver.Add(n[g] <= T.dpn + N * (1 - c))
        save = []
        for li, yv in y[T.r].items():
            v = solver.NumVar(0, 1, f"v{li}")
            solver.Add(v <= yv)
            solver.Add(v <= c)
            solver.Add(v >= yv + c - 1)
            save.append(float(T.t[T.r][li] - T.tintra[li]) * v)
        ts[T.r] = ts[T.r] - sum(save)
    big_t = sum(float(max(T.t[s][li] for li in T.cands[s])) for s in range(S))
    C = [solver.NumVar(0, solver.infinity(), f"C{p}") for p in range(3)]
    for g in T.groups:
        for p in range(3):
            members = [s for s in g if T.stages[s].phase == p]
            if members:
                solver.Add(C[p] >= sum(ts[s] for s in members) - big_t * (1 - x[g]))
    solver.Minimize(sum(C))
    status = solver.Solve()
    ms = (time.perf_counter() - start) * 1e3
    names = {
        pywraplp.Solver.OPTIMAL: "optimal",
        pywraplp.Solver.FEASIBLE: "feasible (time limit, not proven)",
        pywraplp.Solver.INFEASIBLE: "infeasible",
        pywraplp.Solver.NOT_SOLVED: "not solved (time limit)",
    }
    st = names.get(status, f"status {status}")
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return MilpResult("scip", None, False, st, ms, None, solver.NumVariables())
    groups = [g for g in T.groups if x[g].solution_value() > 0.5]
    choice = {s: max(y[s], key=lambda li, s=s: y[s][li].solution_value()) for s in range(S)}
    plan = T.build(workload, groups, choice)
    obj = costmodel.step_latency(plan, workload).total_s
    return MilpResult(
        "scip", obj, status == pywraplp.Solver.OPTIMAL, st, ms, plan, solver.NumVariables()
    )


def solve_cpsat(
    workload: Workload,
    cluster: ClusterSpec,
    costmodel: CostModel,
    *,
    devices: Iterable[int] | None = None,
    time_limit_s: float = 60.0,
    num_workers: int = 1,
) -> MilpResult:
    """Solve the planning model with CP-SAT (times in integer microseconds).

    Returns:
        MilpResult; ``objective_s`` is the chosen plan's exact cost-model latency.
    """
    start = time.perf_counter()
    T = _Tables(workload, cluster, costmodel, devices)
    m = cp_model.CpModel()
    S, N = len(T.stages), T.N
    us = [np.rint(np.asarray(T.t[s]) * 1e6).astype(np.int64) for s in range(S)]
    us_intra = np.rint(np.asarray(T.tintra) * 1e6).astype(np.int64)
    x = {g: m.NewBoolVar(f"x{g}") for g in T.groups}
    n = {g: m.NewIntVar(0, N, f"n{g}") for g in T.groups}
    y = [{li: m.NewBoolVar(f"y{s}_{li}") for li in T.cands[s]} for s in range(S)]
    if any(not ys for ys in y):
        return _empty(m, "cpsat", start, "infeasible (a stage fits no layout)")
    tab = T.tables
    for s in range(S):
        m.AddExactlyOne(x[g] for g in T.groups if s in g)
        m.AddExactlyOne(y[s].values())
    for g in T.groups:
        for s in g:
            m.Add(n[g] >= sum(int(tab[s].d[li]) * v for li, v in y[s].items())).OnlyEnforceIf(x[g])
        m.Add(n[g] == 0).OnlyEnforceIf(x[g].Not())
        m.Add(
            sum(int(tab[s].mem[li]) * v for s in g for li, v in y[s].items()) <= T.cap
        ).OnlyEnforceIf(x[g])
    m.Add(sum(n.values()) <= N)
    ts = []
    hi = [int(max(us[s][li] for li in T.cands[s])) for s in range(S)]
    for s in range(S):
        tv = m.NewIntVar(0, hi[s], f"t{s}")
        m.Add(tv == sum(int(us[s][li]) * v for li, v in y[s].items()))
        ts.append(tv)
    if not T.one_node:
        c = m.NewBoolVar("c")
        both = [g for g in T.groups if T.r in g and T.a in g]
        m.AddBoolOr([x[g] for g in both]).OnlyEnforceIf(c)
        for g in both:
            m.Add(n[g] <= T.dpn).OnlyEnforceIf([c, x[g]])
        tr = m.NewIntVar(0, hi[T.r], "trollout")
        m.Add(tr == sum(int(us[T.r][li]) * v for li, v in y[T.r].items())).OnlyEnforceIf(c.Not())
        m.Add(tr == sum(int(us_intra[li]) * v for li, v in y[T.r].items())).OnlyEnforceIf(c)
        ts[T.r] = tr
    C = [m.NewIntVar(0, sum(hi), f"C{p}") for p in range(3)]
    for g in T.groups:
        for p in range(3):
            members = [s for s in g if T.stages[s].phase == p]
            if members:
                m.Add(C[p] >= sum(ts[s] for s in members)).OnlyEnforceIf(x[g])
    m.Minimize(sum(C))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = num_workers
    status = solver.Solve(m)
    ms = (time.perf_counter() - start) * 1e3
    st = solver.StatusName(status).lower()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return MilpResult("cpsat", None, False, st, ms, None, len(m.Proto().variables))
    groups = [g for g in T.groups if solver.Value(x[g])]
    choice = {s: next(li for li, v in y[s].items() if solver.Value(v)) for s in range(S)}
    plan = T.build(workload, groups, choice)
    obj = costmodel.step_latency(plan, workload).total_s
    if status == cp_model.FEASIBLE:
        st = "feasible (time limit, not proven)"
    return MilpResult(
        "cpsat", obj, status == cp_model.OPTIMAL, st, ms, plan, len(m.Proto().variables)
    )
