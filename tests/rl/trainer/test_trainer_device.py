"""Where the trainer's workers hold their stages: the ``device`` option.

The CPU run is the ``device="cpu"`` case of the GPU code (nereus_rl.trainer.worker_device):
these tests check the option's bad input before any process starts, how a worker
picks its GPU, that the CPU path neither copies nor stages (so the EMU units read
the live shards), which transport ``rl.move`` reshards over (gloo on CPU, one NCCL
communicator per world on GPU), and, where a GPU exists, a short run on it.
"""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

from nereus_rl.cli import main
from nereus_rl.trainer import worker_device as wd
from nereus_rl.trainer.config import check_local_devices
from nereus_rl.trainer.trainer import NotEnoughDevicesError, TrainConfig, TrainConfigError, train
from nereus_rl.trainer.worker_device import (
    CPU,
    drop_move_transport,
    host,
    move_transport,
    on_device,
    worker_device,
)

HAS_CUDA = torch.cuda.is_available()


def test_unknown_device_is_refused_before_any_process():
    with pytest.raises(TrainConfigError, match=r"unknown device 'tpu'.*'cuda'"):
        train(steps=1, device="tpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message of a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_before_any_process(tmp_path):
    with pytest.raises(TrainConfigError, match=r"no GPU.*device='cpu'"):
        train(steps=1, device="cuda", run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


def test_cli_device_is_passed_and_checked(capsys):
    assert main(["train", "--device", "tpu", "--steps", "1"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_more_workers_than_gpus_is_refused(monkeypatch):
    # torch's answers stand in for a machine with two GPUs; the check is what is tested
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_local_devices(TrainConfig(devices=2, device="cuda"))
    check_local_devices(TrainConfig(devices=8, device="cpu"))  # host workers: any number
    with pytest.raises(NotEnoughDevicesError, match=r"devices=4.*has 2.*devices<=2"):
        check_local_devices(TrainConfig(devices=4, device="cuda"))


def test_worker_device_choice(monkeypatch):
    assert worker_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device kind 'xpu'"):
        worker_device("xpu", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="worker 1 sees no GPU"):
        worker_device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert worker_device("cuda", 6) == torch.device("cuda", 2)  # rank modulo the GPUs
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert worker_device("cuda", 6) == torch.device("cuda", 1)  # torchrun's word wins


def test_the_cpu_path_neither_copies_nor_stages():
    # A CPU worker's EMU units read the live shards through host, and its commands
    # take the driver's tensors through on_device: both must be the same objects.
    t = torch.arange(6.0)
    batch = {"sequences": t, "prompt_len": 3, "parts": [t, (t, None)]}
    moved = on_device(batch, CPU)
    assert moved["sequences"] is t and moved["prompt_len"] == 3
    assert moved["parts"][0] is t and moved["parts"][1][0] is t and moved["parts"][1][1] is None
    assert isinstance(moved["parts"][1], tuple)
    assert host({"w": t})["w"] is t


class _RecordedNccl:
    """Stands in for NcclTransport (which needs a GPU) to test when the worker builds,
    keeps and aborts its move transport; the transport itself is tested on a GPU."""

    device_type = "cuda"
    made: ClassVar[list] = []

    def __init__(self, store, rank, ranks, device, *, key, init_timeout):
        self.args = (store, rank, tuple(ranks), device, key, init_timeout)
        self.aborted = False
        _RecordedNccl.made.append(self)

    def abort(self):
        self.aborted = True


def test_a_gpu_worker_moves_over_one_nccl_transport_per_world(monkeypatch):
    monkeypatch.setattr(wd, "NcclTransport", _RecordedNccl)
    _RecordedNccl.made = []
    gpu = torch.device("cuda", 1)
    rl = {"device": gpu, "rank": 2, "world": ("store", 3), "timeout": 7.0}
    first = move_transport(rl)
    assert first.args == ("store", 2, (0, 1, 2), gpu, "nereus_rl/move", 7.0)
    assert move_transport(rl) is first  # built once, at the first move of the world
    drop_move_transport(rl)  # what rl.init does before it joins the next world
    assert first.aborted and "nccl_move" not in rl
    rl["world"] = ("store2", 2)
    second = move_transport(rl)
    assert second is not first and second.args[:3] == ("store2", 2, (0, 1))
    drop_move_transport({})  # a CPU worker (or a first init) has none: nothing to do


def test_a_cpu_worker_moves_over_gloo(monkeypatch):
    monkeypatch.setattr(wd, "NcclTransport", _RecordedNccl)
    monkeypatch.setattr(wd, "GlooTransport", lambda: "gloo on the default group")
    _RecordedNccl.made = []
    rl = {"device": CPU, "rank": 0, "world": ("store", 2), "timeout": 7.0}
    assert move_transport(rl) == "gloo on the default group"
    assert _RecordedNccl.made == [] and "nccl_move" not in rl


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_a_short_run_on_the_gpu():
    # rl.move's weight sync goes over NcclTransport here: it refuses host tensors and
    # gloo refuses device ones, so finishing the run means the device path ran.
    res = train(devices=1, steps=2, device="cuda", warm_steps=30, batch=4, group_size=2)
    assert res.error is None, res.error
    assert len(res.metrics) == 2
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["reward_mean"]) for m in res.metrics)
