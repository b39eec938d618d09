"""The cost model prices a step at the padded work that ran: a dataset batch's prompt
width is its left-padded columns (the trainer's ``prompt_len`` metric), not the
dataset's longest prompt. No processes: the adapter observes a step's metrics."""

from __future__ import annotations

from types import SimpleNamespace

from nereus_rl.trainer.adapt.adapter import Adapter
from nereus_rl.trainer.config import TrainConfig, check_config, simple_plan

CFG = TrainConfig(devices=2, steps=4, batch=4, group_size=2, length_start=8, length_end=8)
# a step's measurements (the same for both batches: only the prediction is compared)
STEP = {
    "response_len": 8, "step_s": 0.1, "head_start_s": 0.0,
    "stage_s": {"rollout": 0.01, "reward": 0.0, "inference": 0.01, "train": 0.02},
    "inference_work_s": {"reference": 0.01},
}  # fmt: skip


def _adapter(task) -> Adapter:
    return Adapter(CFG, check_config(CFG), task, lambda step: 8, host=None, enabled=True)


def _predicted(task, prompt_len: int) -> float:
    plan = simple_plan("grpo", 2, "colocated")
    out, _ = _adapter(task).observe(0, {**STEP, "prompt_len": prompt_len}, plan)
    return out["predicted_step_s"]


def test_a_batch_of_short_prompts_is_priced_below_one_of_long_prompts():
    dataset = SimpleNamespace(prompt_len=lambda rlen: 64)  # its longest prompt: 64 tokens
    short, long = _predicted(dataset, 8), _predicted(dataset, 64)
    assert short < long
    ad = _adapter(dataset)
    assert ad.workload(8, 8).prompt_len == 8 and ad.workload(8).prompt_len == 64
    # one object per (length, width): the cost model's caches find it at once
    assert ad.workload(8, 8) is ad.workload(8, 8) and ad.workload(8, 64) is ad.workload(8)
