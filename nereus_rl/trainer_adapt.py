"""Adaptation loop (placeholder while the static path is brought up)."""

from __future__ import annotations

from typing import Any

from nereus_rl.globalplan import GlobalPlan


class Adapter:
    def __init__(self, trainer, enabled: bool) -> None:
        self.trainer = trainer
        self.enabled = enabled

    def initial_plan(self, response_len: int) -> GlobalPlan:
        from nereus_rl.trainer import simple_plan

        cfg = self.trainer.cfg
        kind = "colocated" if cfg.plan == "auto" else cfg.plan
        return simple_plan(cfg.algo, cfg.devices, kind)

    def boundary(self, step: int, m: dict[str, Any]) -> dict[str, Any]:
        return {}
