"""One RL step's data work on the workers, for :class:`nereus_rl.trainer.trainer.Trainer`.

Sampling the prompts and sending them to the rollout units, gathering the responses,
scoring them, the reference (and PPO critic) inference, the advantages (GRPO group
normalized, PPO GAE, ReMax greedy baseline) and the training stages' optimizer steps.
The trainer's loop (:meth:`Trainer._step`) decides when each runs (sync or async)
and where (its current plan); this module is what each does.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nereus_rl.algos.grpo import group_advantages
from nereus_rl.algos.ppo import gae, kl_penalized_rewards
from nereus_rl.algos.remax import remax_advantages


def _split(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Split rows evenly over units (sizes differ by at most one; rows stay in order)."""
    n = t.shape[0]
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    return list(t.split(sizes))


def _gather(replies: dict[int, Any], key: str) -> torch.Tensor:
    outs = sorted((r for r in replies.values() if r is not None), key=lambda r: r["unit"])
    return torch.cat([r[key] for r in outs])


def _stage_seconds(replies: dict[int, Any]) -> float:
    return max((r["seconds"] for r in replies.values() if r is not None), default=0.0)


def head_start(t_step: float, submitted_at: float, t_wait: float, rollout_s: float) -> float:
    """Seconds sooner a step reached the end of its critical rollout because the
    rollout was sent before the step began (0 when it was not).

    The rollout ran ``rollout_s`` (as its workers time it) from ``submitted_at``; the
    step began at ``t_step`` and, by ``t_wait``, had nothing left to do but wait for it
    (sync mode: at once; async: training done). Sent at ``t_step``, it would have ended
    at ``t_step + rollout_s``; the step goes on at the later of its own work's end and
    the rollout's, so the difference is what the head start saved: up to the whole
    rollout when the rollout is the step's critical path, nothing when the step's own
    work was longer.
    """
    if submitted_at >= t_step:
        return 0.0
    late = max(t_wait, t_step + rollout_s)
    early = max(t_wait, submitted_at + rollout_s)
    return max(0.0, late - early)


class StepWork:
    """Mixin of :class:`~nereus_rl.trainer.trainer.Trainer`: the rollout and training work of a
    step. Uses the trainer's ``cfg``, ``task``, ``prompts``, ``rng``, ``drawn``, ``plan``,
    ``driver``, ``response_len`` and ``_submit_stage``.

    Prompts of different lengths (a dataset's) are left-padded to the batch's longest with
    a prompt mask (``prompts.encode``); every response then starts at the same column,
    and the mask goes with the rows to every stage (generation, inference, training), so
    padding is never attended to and never scored: losses, advantages and KL read the
    response columns only, under the response mask."""

    def _draw(self, step: int, rlen: int | None = None) -> tuple[int, list]:
        """The step's task level and prompts (problems), drawn once per step."""
        cfg = self.cfg
        rlen = self.response_len(step) if rlen is None else rlen
        # The response limit follows the length schedule; the task level stays at the
        # first step's (fixed_level) so that reward can rise while responses grow.
        level = self.task.level_for_response_len(self.response_len(0) if cfg.fixed_level else rlen)
        # Drawn once per step, in step order, from the run's one generator: a step run
        # again after a recovery gets the same prompts, and no step is skipped.
        drawn = self.drawn.get(step)
        if drawn is None or drawn[0] != level:
            drawn = self.drawn[step] = (level, self.task.sample(cfg.batch, level, self.rng))
            for old in [s for s in self.drawn if s < step - 2]:
                del self.drawn[old]
        return drawn

    def _rollout_submit(self, step: int, rlen: int | None = None):
        """Sample a step's prompts and send them to the rollout units (not waiting);
        ``rlen`` overrides the step's response limit (the startup calibration's probes)."""
        cfg = self.cfg
        rlen = self.response_len(step) if rlen is None else rlen
        level, problems = self._draw(step, rlen)
        if cfg.algo == "grpo":
            problems = [p for p in problems for _ in range(cfg.group_size)]
        prompts, prompt_mask = self.prompts.encode(problems)
        rp = self.plan.stage("rollout")
        parts = _split(prompts, rp.dp)
        kwargs: dict[str, Any] = {"greedy": cfg.algo == "remax", "pad_id": self.prompts.pad_id}
        if prompt_mask is not None:
            kwargs["prompt_masks"] = _split(prompt_mask, rp.dp)
        pend = self._submit_stage(
            "rl.generate",
            "rollout",
            parts,
            rlen,
            cfg.temperature,
            cfg.seed * 100_003 + step,
            self.prompts.eos_id,
            **kwargs,
        )
        return {
            "step": step,
            "problems": problems,
            "prompt_mask": prompt_mask,
            "rlen": rlen,
            "level": level,
            "pend": pend,
            "submitted_at": time.perf_counter(),
        }

    def _rollout_wait(self, job) -> dict[str, Any]:
        rep = self.driver.wait(job["pend"])
        job["sequences"] = _gather(rep, "sequences")
        job["mask"] = _gather(rep, "mask")
        job["old_logp"] = _gather(rep, "logp")
        job["rollout_s"] = _stage_seconds(rep)
        if self.cfg.algo == "remax":
            job["greedy"] = _gather(rep, "greedy")
        return job

    def _train_on(self, job) -> dict[str, Any]:
        """Reward, reference (and critic) inference, advantages and the training stages."""
        cfg = self.cfg
        seqs, mask, old_logp = job["sequences"], job["mask"], job["old_logp"]
        plen = seqs.shape[1] - mask.shape[1]
        problems = job["problems"]
        prompt_mask = job.get("prompt_mask")
        t0 = time.perf_counter()
        scores = self.prompts.score(problems, seqs[:, plen:])
        reward_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        # PPO's reference and critic inference are submitted together: on disjoint
        # devices they run side by side (as the cost model prices the phase).
        inf_stages = ("reference", "critic_inference") if cfg.algo == "ppo" else ("reference",)
        inf_pend = []
        for s in inf_stages:
            dp = self.plan.stage(s).dp
            masks = None if prompt_mask is None else _split(prompt_mask, dp)
            inf_pend.append(
                self._submit_stage(
                    "rl.infer", s, _split(seqs, dp), plen, cfg.num_micro, prompt_masks=masks
                )
            )
        inf_rep = [self.driver.wait(p) for p in inf_pend]
        ref_logp = _gather(inf_rep[0], "out")
        values = _gather(inf_rep[1], "out") if cfg.algo == "ppo" else None
        infer_s = time.perf_counter() - t0
        # each inference stage as its workers time it: the driver's infer_s also holds
        # the wait behind an async rollout on shared workers (and the calls' overhead)
        infer_work_s = {s: _stage_seconds(r) for s, r in zip(inf_stages, inf_rep)}
        num_tokens = float(mask.sum())
        batch: dict[str, torch.Tensor] = {
            "sequences": seqs,
            "mask": mask,
            "old_logp": old_logp,
            "ref_logp": ref_logp,
        }
        if prompt_mask is not None:
            batch["prompt_mask"] = prompt_mask
        if cfg.algo == "grpo":
            batch["advantages"] = group_advantages(scores, cfg.group_size)
        elif cfg.algo == "ppo":
            rewards = kl_penalized_rewards(scores, old_logp, ref_logp, mask, kl_coef=cfg.kl_coef)
            adv, ret = gae(rewards, values, mask, whiten=True)
            batch.update(advantages=adv, returns=ret, old_values=values)
        else:
            gscores = self.prompts.score(problems, job["greedy"])
            rewards = kl_penalized_rewards(scores, old_logp, ref_logp, mask, kl_coef=cfg.kl_coef)
            batch["advantages"] = remax_advantages(rewards, gscores, mask)
        t0 = time.perf_counter()
        hp = {**cfg.hyper(), "lr": self._lr(job["step"])}
        pend = []
        for stage in ("actor_train", "critic_train") if cfg.algo == "ppo" else ("actor_train",):
            sp = self.plan.stage(stage)
            parts = []
            for rows in _split(torch.arange(seqs.shape[0]), sp.dp):
                b = {k: v[rows] for k, v in batch.items()}
                b["prompt_len"] = torch.tensor(plen)
                b["num_tokens"] = torch.tensor(num_tokens)
                parts.append(b)
            pend.append((stage, self._submit_stage("rl.train", stage, parts, hp)))
        stats: dict[str, float] = {}
        train_s = 0.0
        for stage, p in pend:
            rep = self.driver.wait(p)
            train_s = max(train_s, _stage_seconds(rep))
            outs = [r for r in rep.values() if r is not None]
            prefix = "critic_" if stage == "critic_train" else ""
            # each unit's loss was scaled by dp (the gradient all-reduce averages)
            dp = self.plan.stage(stage).dp
            stats[prefix + "loss"] = sum(r["loss"] for r in outs) / dp
            for r in outs:
                for k, v in r["stats"].items():
                    stats[prefix + k] = stats.get(prefix + k, 0.0) + v / dp
        kl = float(((old_logp - ref_logp) * mask).sum() / max(num_tokens, 1.0))
        return {
            "reward_mean": float(scores.mean()),
            "reward_exact": float((scores >= 1.0).float().mean()),
            "kl": kl,
            "loss": stats.get("loss", 0.0),
            "critic_loss": stats.get("critic_loss"),
            "response_tokens_mean": float(mask.sum(-1).mean()),
            "stage_s": {
                "rollout": job["rollout_s"],
                "reward": reward_s,
                "inference": infer_s,
                "train": train_s,
            },
            "inference_work_s": infer_work_s,
        }

    def _lr(self, step: int) -> float:
        # Linear warm-up after the warm start: the first RL updates are the noisiest.
        return self.cfg.lr * min(1.0, (step + 1) / max(1, self.cfg.warmup_steps))
