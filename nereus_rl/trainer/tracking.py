"""The run's metrics for the tools people watch runs with: TensorBoard event files in the
run folder, and Weights & Biases when it is installed and asked for (``wandb=True``,
``nereus-rl train --wandb``).

Both get the same scalars as metrics.jsonl, under the tags :func:`scalars` gives them:
a metric's section (``time/``, ``reward/``, ``loss/``, ``kl/``, ``predicted/``,
``memory/``, ``length/``, ``plan/``, ``other/``) and then its metrics.jsonl name, with a
nested dict's keys after a slash (``time/stage_s/rollout``). One tag is derived:
``predicted/measured_step_s`` (``step_s + head_start_s``, the step as the cost model
prices it), which the TensorBoard chart "predicted vs measured" draws beside
``predicted/predicted_whole_s``. Plan changes and decisions go in as text.

W&B follows its own environment (``WANDB_MODE=offline`` writes the run under the run
folder's ``wandb/`` and sends nothing; ``wandb sync`` uploads it later).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

from nereus_rl.data.datasets import OptionalDependencyError

_LOG = logging.getLogger(__name__)

#: The derived tag: the step as the cost model prices it (see the module docstring).
MEASURED_STEP = "predicted/measured_step_s"

_MEMORY = ("held_bytes_max", "peak_memory_fraction", "memory_budget_bytes")
_LENGTH = ("response_len", "response_tokens_mean", "prompt_len")
_PLAN = ("num_devices", "level")


class WandbMissingError(OptionalDependencyError):
    """``wandb=True`` without the ``wandb`` package installed."""


def section(key: str) -> str:
    """The tag section of a top-level metrics.jsonl key (see the module docstring)."""
    if key.startswith("reward"):
        return "reward"
    if key.startswith("predicted_"):
        return "predicted"
    if key == "kl":
        return "kl"
    if key.endswith("loss") or key.startswith("critic_"):
        return "loss"
    if key in _MEMORY:
        return "memory"
    if key in _LENGTH:
        return "length"
    if key in _PLAN:
        return "plan"
    if key.endswith("_s"):
        return "time"
    return "other"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The tagged numbers of one metrics.jsonl row: every finite number, nested dicts
    flattened (``stage_s/rollout``), strings, None and NaN left out; plus the derived
    ``predicted/measured_step_s``. The ``step`` itself is the x axis, not a tag."""
    out: dict[str, float] = {}
    for key, v in row.items():
        if key == "step":
            continue
        if isinstance(v, dict):
            for sub, x in v.items():
                x = _number(x)
                if x is not None:
                    out[f"{section(key)}/{key}/{sub}"] = x
            continue
        x = _number(v)
        if x is not None:
            out[f"{section(key)}/{key}"] = x
    step_s = _number(row.get("step_s"))
    if step_s is not None:
        out[MEASURED_STEP] = step_s + (_number(row.get("head_start_s")) or 0.0)
    return out


def import_wandb():
    """The ``wandb`` module.

    Raises:
        WandbMissingError: it is not installed (the message says how to install it).
    """
    try:
        import wandb
    except ImportError:
        raise WandbMissingError(
            "wandb=True (--wandb) needs the package 'wandb', which is not installed; "
            "install it with `pip install wandb` (or `pip install nereus[wandb]`), or "
            "drop the option: TensorBoard event files are written to the run folder anyway"
        ) from None
    return wandb


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


class Trackers:
    """TensorBoard (always, when ``tensorboard`` is importable) and W&B (when asked) for
    one run folder.

    Arguments:
        run_dir: the run folder; the event files go in it, and W&B's ``wandb/`` folder.
        config: the run's TrainConfig (W&B's run config; its ``wandb`` field asks for W&B,
            ``wandb_project`` names the project).

    Raises:
        WandbMissingError: W&B asked for but not installed.
    """

    def __init__(self, run_dir: str | Path, config: Any) -> None:
        self.dir = Path(run_dir)
        self.tb = None
        self.wandb_run = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # a declared dependency; an install without it keeps the jsonl
            _LOG.warning("tensorboard is not installed: no event files in %s", self.dir)
        else:
            self.tb = SummaryWriter(log_dir=str(self.dir), flush_secs=10)
            self.tb.add_custom_scalars(
                {
                    "nereus": {
                        "predicted vs measured step (s)": [
                            "Multiline",
                            ["predicted/predicted_whole_s", MEASURED_STEP],
                        ],
                        "step, transition and boundary (s)": [
                            "Multiline",
                            ["time/step_s", "time/transition_s", "time/boundary_s"],
                        ],
                    }
                }
            )
        if getattr(config, "wandb", False):
            wandb = import_wandb()
            cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {}
            self.wandb_run = wandb.init(
                project=getattr(config, "wandb_project", None) or "nereus-rl",
                name=self.dir.name,
                dir=str(self.dir),
                config=_plain(cfg),
            )

    def metrics(self, row: dict[str, Any]) -> None:
        """One step's metrics.jsonl row, at its ``step``."""
        step = int(row.get("step", 0))
        values = scalars(row)
        if self.tb is not None:
            for tag, v in values.items():
                self.tb.add_scalar(tag, v, step)
            self.tb.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def plan(self, step: int, plan: Any) -> None:
        """The plan in force from ``step`` on, as text."""
        if self.tb is not None:
            self.tb.add_text("plan", f"`{plan!r}`", step)
        if self.wandb_run is not None:
            self.wandb_run.summary["plan"] = repr(plan)

    def decision(self, row: dict[str, Any]) -> None:
        """One decision (taken or not), as text at its step."""
        if self.tb is not None:
            verdict = "TAKE" if row.get("taken") else "KEEP"
            text = f"{verdict} on {row.get('signal')}: {row.get('reason') or ''}"
            if row.get("candidate"):
                text += f" -> `{row['candidate']}`"
            self.tb.add_text("decision", text, int(row.get("step", 0)))

    def images(self, paths: list[Path]) -> None:
        """The run's plots, once drawn (W&B only: TensorBoard users open the PNGs)."""
        if self.wandb_run is None:
            return
        import wandb

        got = {f"plots/{p.stem}": wandb.Image(str(p)) for p in paths if p.exists()}
        if got:
            self.wandb_run.log(got)

    def close(self, error: str | None = None) -> None:
        """Flush and close the writers (``error``: why the run stopped early)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            if error:
                self.wandb_run.summary["error"] = error
            self.wandb_run.finish(exit_code=1 if error else 0)
            self.wandb_run = None
