"""The run folder: metrics.jsonl, decisions.jsonl, plans.jsonl, workers.jsonl, TensorBoard
event files (and W&B's ``wandb/`` when asked for: :mod:`nereus_rl.trainer.tracking`),
plots and a summary table.

Lines are appended and flushed as they happen, so a run that stops early (a
worker died, Ctrl-C) keeps everything logged up to that point. A decisions.jsonl line is
one ``Decision.to_row(outcome)``; its schema is :mod:`nereus_rl.policy.decision`. A
plans.jsonl line is ``{"step", "plan": repr, "stages": [{"stage", "model", "trains",
"dp", "tp", "pp", "units"}, ...]}``: the plan in force from that step on.

The plots: latency_plan.png (step latency with the transitions, response length, and
each stage's layout and devices over the steps) and reward_kl.png. :func:`plot_run_dir`
draws them again from a run folder's files.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

from nereus_rl.core.globalplan import fmt_devices
from nereus_rl.trainer.config import stage_desc
from nereus_rl.trainer.tracking import Trackers


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
        config: the run's TrainConfig (written to config.json; its ``wandb`` field asks
            for a W&B run beside the TensorBoard event files).

    Raises:
        WandbMissingError: W&B asked for but not installed.
    """

    def __init__(self, run_dir: str | Path, config: Any) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(
            json.dumps(_plain(dataclasses.asdict(config)), indent=1) + "\n"
        )
        self.trackers = Trackers(self.dir, config)
        self._files = {}
        for name in ("metrics", "decisions", "plans", "workers"):
            self._files[name] = open(self.dir / f"{name}.jsonl", "w")
        self.started = time.time()

    def _write(self, name: str, row: dict[str, Any]) -> None:
        f = self._files[name]
        f.write(json.dumps(_plain(row)) + "\n")
        f.flush()

    def metrics(self, row: dict[str, Any]) -> None:
        """Append one step's metrics (and send them to TensorBoard / W&B)."""
        self._write("metrics", row)
        self.trackers.metrics(row)

    def decision(self, row: dict[str, Any]) -> None:
        """Append one decision's row (see :mod:`nereus_rl.policy.decision`)."""
        self._write("decisions", row)
        self.trackers.decision(row)

    def plan(self, step: int, plan: Any) -> None:
        """Record the plan in force from ``step`` on."""
        row: dict[str, Any] = {"step": step, "plan": repr(plan)}
        if hasattr(plan, "stages"):
            row["stages"] = [stage_desc(sp) for sp in plan.stages]
        self._write("plans", row)
        self.trackers.plan(step, plan)

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
            plot_run(result.metrics, result.decisions, self.dir, read_plans(self.dir))
        except Exception as e:
            (self.dir / "plot_error.txt").write_text(f"{type(e).__name__}: {e}\n")
        try:
            self.trackers.images([self.dir / "latency_plan.png", self.dir / "reward_kl.png"])
        finally:
            self.trackers.close(result.error)
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


# a GlobalPlan's printed stage: "rollout[dp2 tp1 pp1 @ 0-1]"
_STAGE_RE = re.compile(r"(\w+)\[dp(\d+) tp(\d+) pp(\d+) @ ([\d,\-]+)\]")


def _device_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def read_plans(run_dir: str | Path) -> list[tuple[int, list[dict[str, Any]]]]:
    """The plans of a run folder's plans.jsonl: (first step, stages) in step order, each
    stage a dict with ``stage``, ``dp``, ``tp``, ``pp`` and ``units`` (device lists).
    Rows written without ``stages`` are read from the plan's printed form (its devices
    then make one list). A folder without the file gives []."""
    path = Path(run_dir) / "plans.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        stages = row.get("stages")
        if stages is None:
            stages = [
                {"stage": n, "dp": int(dp), "tp": int(tp), "pp": int(pp),
                 "units": [_device_list(devs)]}
                for n, dp, tp, pp, devs in _STAGE_RE.findall(row.get("plan", ""))
            ]  # fmt: skip
        out.append((int(row["step"]), stages))
    out.sort(key=lambda x: x[0])
    return out


def layout_panel(ax: Any, plans: list[tuple[int, list[dict[str, Any]]]], last_step: int) -> None:
    """Draw each stage's devices over the steps on ``ax``: one band of rows per stage,
    one row per device (device 0 at the band's top), a cell filled where the stage holds
    that device at that step (shaded by unit, so that a stage's dp replicas tell apart),
    and the stage's ``dp tp pp @ devices`` written where its layout starts or changes.
    ``last_step``: the last step drawn (the last plan lasts until it)."""
    import matplotlib.colors as mcolors
    from matplotlib.ticker import MaxNLocator

    if not plans:
        ax.set_title("stage layouts (no plans recorded)")
        return
    names: list[str] = []
    devices = 1
    for _, stages in plans:
        for st in stages:
            if st["stage"] not in names:
                names.append(st["stage"])
            devices = max([devices] + [d + 1 for u in st["units"] for d in u])
    band = devices + 1  # a blank row between stages
    colors = [mcolors.to_rgb(f"C{i % 10}") for i in range(len(names))]
    ends = [s for s, _ in plans[1:]] + [last_step + 1]
    before: dict[str, tuple] = {}
    for (start, stages), end in zip(plans, ends):
        if end <= start:
            continue
        if start > plans[0][0]:
            ax.axvline(start - 0.5, color="tab:red", ls="--", lw=1)
        for st in stages:
            i = names.index(st["stage"])
            top = i * band
            r, g, b = colors[i]
            n = len(st["units"])
            for k, unit in enumerate(st["units"]):
                # later units lighter, so that a stage's replicas tell apart
                w = 1.0 - 0.45 * k / (n - 1) if n > 1 else 1.0
                rgb = (r * w + 1 - w, g * w + 1 - w, b * w + 1 - w)
                for d in unit:
                    ax.broken_barh(
                        [(start - 0.5, end - start)], (top + d + 0.1, 0.8),
                        facecolors=[rgb], edgecolor="white", lw=0.5,
                    )  # fmt: skip
            key = (st["dp"], st["tp"], st["pp"], tuple(map(tuple, st["units"])))
            if before.get(st["stage"]) != key:
                held = sorted(d for u in st["units"] for d in u)
                ax.text(
                    start - 0.4, top - 0.1,
                    f"dp{st['dp']} tp{st['tp']} pp{st['pp']} @ {fmt_devices(held)}",
                    fontsize=7, va="bottom", ha="left",
                )  # fmt: skip
                before[st["stage"]] = key
    ax.set_ylim(len(names) * band - 0.5, -1.2)
    ax.set_yticks([i * band + devices / 2 for i in range(len(names))], names)
    ax.set_xlim(plans[0][0] - 0.5, last_step + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"devices 0-{devices - 1}\nper stage")
    ax.set_xlabel("RL step")
    ax.set_title("stage layouts: devices held at each step (dp tp pp at each change)")


def latency_figure(
    metrics: list[dict[str, Any]],
    decisions: list[dict[str, Any]],
    plans: list[tuple[int, list[dict[str, Any]]]] | None = None,
) -> Any:
    """The latency figure: step latency with the taken transitions, response length and,
    given ``plans`` (:func:`read_plans`), the stages' layouts and devices
    (:func:`layout_panel`). Returns the matplotlib Figure (the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [x["step"] for x in metrics]
    rows = 3 if plans else 2
    layout_h = 0.0
    if plans:
        stages = {st["stage"] for _, ss in plans for st in ss}
        devs = max(d + 1 for _, ss in plans for st in ss for u in st["units"] for d in u)
        layout_h = min(7.0, max(2.4, 0.2 * len(stages) * (devs + 1.5)))
    fig, ax = plt.subplots(
        rows, 1, figsize=(8, 5 + layout_h), sharex=True,
        gridspec_kw={"height_ratios": [2.5, 2.5, 2.5 * layout_h / 2.5][:rows]},
    )  # fmt: skip
    ax[0].plot(steps, [x["step_s"] for x in metrics], marker=".", label="measured")
    pred = [(x["step"], x["predicted_whole_s"]) for x in metrics if "predicted_whole_s" in x]
    if pred:
        ax[0].plot(*zip(*pred), marker=".", ls=":", label="predicted")
    for d in decisions:
        if d.get("taken"):
            ax[0].axvline(d["step"] + 0.5, color="tab:red", ls="--", lw=1)
    ax[0].set_ylabel("seconds")
    ax[0].legend(loc="upper left")
    ax[0].set_title("step latency (red: plan transitions)")
    ax[1].step(steps, [x["response_len"] for x in metrics], where="post", label="response limit")
    ax[1].set_ylabel("tokens")
    ax[1].set_title("response length")
    ax[1].legend(loc="upper left")
    if plans:
        layout_panel(ax[2], plans, max(steps))
    ax[-1].set_xlabel("RL step")
    fig.tight_layout()
    return fig


def plot_run(
    metrics: list[dict[str, Any]],
    decisions: list[dict[str, Any]],
    out: Path,
    plans: list[tuple[int, list[dict[str, Any]]]] | None = None,
) -> None:
    """Two PNGs in ``out``: latency_plan.png (:func:`latency_figure`) and reward_kl.png."""
    if not metrics:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    fig = latency_figure(metrics, decisions, plans)
    fig.savefig(out / "latency_plan.png", dpi=90)
    plt.close(fig)
    steps = [x["step"] for x in metrics]
    fig, ax = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax[0].plot(steps, [x["reward_mean"] for x in metrics], marker=".", label="mean reward")
    ax[0].set_title("reward")
    ax[0].set_ylabel("reward")
    ax[0].legend(loc="upper left")
    ax[1].plot(steps, [x["kl"] for x in metrics], marker=".", color="tab:orange", label="KL")
    ax[1].set_title("KL to the reference")
    ax[1].set_ylabel("KL (per token)")
    ax[1].set_xlabel("RL step")
    ax[1].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "reward_kl.png", dpi=90)
    plt.close(fig)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run_dir(run_dir: str | Path) -> None:
    """Draw a run folder's plots again from its metrics, decisions and plans files."""
    run_dir = Path(run_dir)
    plot_run(
        _read_jsonl(run_dir / "metrics.jsonl"),
        _read_jsonl(run_dir / "decisions.jsonl"),
        run_dir,
        read_plans(run_dir),
    )
