"""The run folder: metrics.jsonl, decisions.jsonl, plans.jsonl, workers.jsonl, plots and a
summary table.

Lines are appended and flushed as they happen, so a run that stops early (a
worker died, Ctrl-C) keeps everything logged up to that point. A decisions.jsonl line is
one ``Decision.to_row(outcome)``; its schema is :mod:`nereus_rl.policy.decision`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


class RunLog:
    """Writes one run's folder.

    Arguments:
        run_dir: the folder (created; existing log files in it are replaced).
        config: the run's TrainConfig (written to config.json).
    """

    def __init__(self, run_dir: str | Path, config: Any) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(
            json.dumps(_plain(dataclasses.asdict(config)), indent=1) + "\n"
        )
        self._files = {}
        for name in ("metrics", "decisions", "plans", "workers"):
            self._files[name] = open(self.dir / f"{name}.jsonl", "w")
        self.started = time.time()

    def _write(self, name: str, row: dict[str, Any]) -> None:
        f = self._files[name]
        f.write(json.dumps(_plain(row)) + "\n")
        f.flush()

    def metrics(self, row: dict[str, Any]) -> None:
        """Append one step's metrics."""
        self._write("metrics", row)

    def decision(self, row: dict[str, Any]) -> None:
        """Append one decision's row (see :mod:`nereus_rl.policy.decision`)."""
        self._write("decisions", row)

    def plan(self, step: int, plan: Any) -> None:
        """Record the plan in force from ``step`` on."""
        self._write("plans", {"step": step, "plan": repr(plan)})

    def workers(self, step: int, pids: dict[int, int]) -> None:
        """Record which process holds each plan device from ``step`` on (at start and
        after each recovery), so that drills and operators can tell a device's worker."""
        self._write("workers", {"step": step, "pids": {str(d): p for d, p in pids.items()}})

    def error(self, message: str) -> None:
        """Record why the run ended early."""
        (self.dir / "error.txt").write_text(message + "\n")

    def finish(self, result: Any) -> Path:
        """Close the logs, draw the plots and write summary.txt. Returns the folder."""
        for f in self._files.values():
            f.close()
        summary = summary_table(result)
        (self.dir / "summary.txt").write_text(summary + "\n")
        try:
            plot_run(result.metrics, result.decisions, self.dir)
        except Exception as e:
            (self.dir / "plot_error.txt").write_text(f"{type(e).__name__}: {e}\n")
        return self.dir


def _total(m: list[dict[str, Any]]) -> float:
    # each step and its boundary (the transition and the deciding around it)
    return sum(x["step_s"] + x.get("boundary_s", x.get("transition_s", 0.0)) for x in m)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summary_table(result: Any) -> str:
    """A short plain-text table of a run: reward, step latency, plans, transitions."""
    m = result.metrics
    cfg = result.config
    lines = [
        f"nereus-rl {cfg.algo} {cfg.model} task={cfg.task} devices={cfg.devices} "
        f"mode={cfg.mode} adapt={cfg.adapt} steps={len(m)}/{cfg.steps}"
    ]
    if result.error:
        lines.append(f"stopped early: {result.error}")
    if m:
        k = max(1, len(m) // 4)
        rows = [
            ("reward (first quarter)", f"{_mean([x['reward_mean'] for x in m[:k]]):.3f}"),
            ("reward (last quarter)", f"{_mean([x['reward_mean'] for x in m[-k:]]):.3f}"),
            ("exact answers (last quarter)", f"{_mean([x['reward_exact'] for x in m[-k:]]):.3f}"),
            ("kl (last)", f"{m[-1]['kl']:.4f}"),
            ("step latency mean (s)", f"{_mean([x['step_s'] for x in m]):.3f}"),
            ("time in RL steps (s)", f"{_total(m):.2f}"),
            ("response length", f"{m[0]['response_len']} -> {m[-1]['response_len']}"),
        ]
        budget = next((x["memory_budget_bytes"] for x in m if "memory_budget_bytes" in x), None)
        if budget:
            rows.append(("memory budget / worker", f"{budget / 2**20:.2f} MiB (predicted peak)"))
        held = [x["held_bytes_max"] for x in m if x.get("held_bytes_max") is not None]
        if held:  # (a step whose worker died before it was read has none)
            rows.append(("state held / worker (max)", f"{max(held) / 2**20:.2f} MiB"))
        taken = [d for d in result.decisions if d.get("taken")]
        rows.append(("decisions (taken)", f"{len(result.decisions)} ({len(taken)})"))
        rows.append(
            (
                "transition time (s)",
                f"{sum(d.get('measured_transition_s') or 0 for d in taken):.3f}",
            )
        )
        rows.append(
            ("deciding at boundaries (s)", f"{sum(x.get('decision_s', 0.0) for x in m):.3f}")
        )
        t = getattr(result, "timings", {})
        if t:
            rows.append(("start-up (s)", " ".join(f"{k[:-2]} {v:.1f}" for k, v in t.items())))
        w = max(len(r[0]) for r in rows)
        lines += [f"  {a:<{w}}  {b}" for a, b in rows]
        lines.append("  plans:")
        for step, plan in result.plans:
            lines.append(f"    step {step:>3}: {plan!r}")
    if result.run_dir is not None:
        lines.append(f"  run folder: {result.run_dir}")
    return "\n".join(lines)


def plot_run(metrics: list[dict[str, Any]], decisions: list[dict[str, Any]], out: Path) -> None:
    """Two PNGs: step latency with plan changes and devices; reward and KL."""
    if not metrics:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [x["step"] for x in metrics]
    fig, ax = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax[0].plot(steps, [x["step_s"] for x in metrics], marker=".", label="step latency (s)")
    for d in decisions:
        if d.get("taken"):
            ax[0].axvline(d["step"] + 0.5, color="tab:red", ls="--", lw=1)
    ax[0].set_ylabel("seconds")
    ax[0].legend(loc="upper left")
    ax[0].set_title("step latency (red: plan transitions)")
    ax[1].step(steps, [x["response_len"] for x in metrics], where="post", label="response len")
    ax[1].set_ylabel("tokens")
    ax[1].set_xlabel("RL step")
    ax[1].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "latency_plan.png", dpi=90)
    plt.close(fig)
    fig, ax = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax[0].plot(steps, [x["reward_mean"] for x in metrics], marker=".", label="mean reward")
    ax[0].legend(loc="upper left")
    ax[1].plot(steps, [x["kl"] for x in metrics], marker=".", color="tab:orange", label="KL")
    ax[1].set_xlabel("RL step")
    ax[1].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "reward_kl.png", dpi=90)
    plt.close(fig)
