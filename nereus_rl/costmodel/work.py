"""Per-stage work and memory of one layout, as ideal seconds per operation class.

The cost model prices a stage as ``sum_c W_c / e_c``: ``W_c`` is the time the stage's
class-``c`` operations would take at the device's peak (FLOPs / peak FLOP/s, bytes /
memory bandwidth, bytes / link bandwidth + latency, kernels x launch overhead) and
``e_c`` the efficiency achieved on that class (``CostModel`` holds and refines them).
Latency is linear in ``1/e``, which makes refinement a linear least-squares fit.

Everything here is per device of one data-parallel unit and depends only on the stage,
its layout ``(dp, tp, pp)`` and the link tier of each of its groups.

Conventions (Llama-style decoder, untied embeddings, causal attention):
    * forward GEMM FLOPs per token per layer = 2 x layer matmul params / tp; backward
      is twice the forward (train = 3x forward);
    * causal attention FLOPs per layer per sequence = 2 s^2 h / tp (forward);
    * pipeline: ``m`` micro-batches take ``m + pp - 1`` slots of one stage's time
      (1F1B bubble); generation splits a replica's batch into ``min(b, pp)`` groups;
    * the last pipeline stage carries the LM (or value) head as well as its layers
      (so per-stage cost is the slower one: conservative);
    * tensor parallel: 2 all-reduces per layer forward, 2 more backward, ring-priced;
    * launch: every eager op of ``nereus_rl.models.model.Decoder`` costs one launch whatever
      its size (``KERNELS_*``, counted with TorchDispatchMode; the test recounts them):
      118 per layer forward, 143 backward, plus embedding/head/loss; these dominate
      small steps, so the count per micro-batch against the per-step optimizer count
      matters more than the FLOPs there;
    * mem: each micro-batch streams the weights (1 pass forward, 4 for train: forward
      read, input-gradient read, weight-gradient read + write), the roofline of a GEMM
      call: with ``t`` tokens per micro-batch its time is ``flops/e_gemm + bytes/e_mem``,
      i.e. an efficiency that saturates as ``t / (t + t0)``;
    * elementwise: activation temporaries (norms, rotary, SwiGLU, softmax...) written
      and read once: ``2 x ACT_ELEMS x hidden`` elements per token per layer, its own
      class because they are cache-resident on small models where weights are not;
    * training state: 16 bytes per parameter (bf16 weights and grads, fp32 master
      copy and Adam moments), optimizer step streams it twice through memory (mem)
      and launches 11 eager ops per parameter tensor (AdamW foreach=False, zero_grad).
    * local CPU workers (``LocalCpuClusterSpec``): the device spec is a worker's share
      of a core when every worker is busy; a stage on ``d`` workers keeps ``d`` busy
      (a lower bound: other groups may run in the same phase), so its compute classes
      scale by ``min(1, cores/d) / min(1, cores/N)`` (whole cores back when ``d`` is
      at most the cores), and each of its ``d - 1`` co-running workers adds
      ``INTERFERENCE_PER_CORUNNER x (launch + mem)`` (the parts that need code and
      weights in cache) to one of two classes: ``contention`` for the ``a - 1`` that run
      at the same instant on other cores (``a = min(d, cores)``: shared L3 and memory
      bandwidth), ``interference`` for the ``d - a`` that time-slice a core with another
      (L1/L2 refilled after each switch). The two start equal and are fitted apart:
      measured, two workers on two cores take more CPU time for the same work than two
      time-slicing one core (bench_costmodel).
Memory per device (bytes), the largest pipeline stage charged to every device:
    * weights (+ grads and optimizer state when training);
    * training activations after Korthikanti et al. 2022 (tensor parallel without
      sequence parallel, flash attention so no s^2 score term):
      ``s * b * h * (10 + 24 / tp)`` bytes per layer per micro-batch in flight, with
      ``min(m, pp)`` micro-batches in flight on the first stage (1F1B);
      plus fp32 logits and their gradient;
    * inference: one layer's activations and the logits of one micro-batch;
    * generation: the KV cache of all of the replica's sequences at full length.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from nereus_rl.core.spec import ClusterSpec, LocalCpuClusterSpec, ModelSpec
from nereus_rl.core.workload import StageWork


class CostModelError(ValueError):
    """Bad input to the cost model (a plan that misses a stage, an unknown class...)."""


CLASSES = (
    "gemm",
    "attention",
    "mem",
    "elementwise",
    "launch",
    "allreduce:intra",
    "allreduce:inter",
    "allgather:intra",
    "allgather:inter",
    "p2p:intra",
    "p2p:inter",
    "interference",
    "contention",
)
CLASS_INDEX = {c: i for i, c in enumerate(CLASSES)}
NUM_CLASSES = len(CLASSES)
TRAIN_STATE_BYTES_PER_PARAM = 16
# Eager ops dispatched by ``nereus_rl.models.model.Decoder`` (counted with TorchDispatchMode,
# checked by tests/rl/costmodel/test_costmodel.py): per layer, and for the rest of the model
# (embedding, final norm, head, loss). Each costs a launch / dispatch whatever its size;
# on small steps these, not the FLOPs, set the time.
KERNELS_PER_LAYER_FWD = 118
KERNELS_PER_LAYER_BWD = 143
KERNELS_HEAD_FWD = 21
KERNELS_HEAD_BWD = 34
KERNELS_PER_LAYER_DECODE = 121
KERNELS_HEAD_DECODE = 13
TENSORS_PER_LAYER = 9  # q, k, v, o, gate, up, down, two norms
# Every micro-batch streams the weights through memory: forward reads them, backward
# reads them again (input gradients) and reads + writes the weight gradients.
WEIGHT_PASSES_FWD = 1
WEIGHT_PASSES_TRAIN = 4
# Activation elements the eager ops write per token per layer, in units of hidden
# (temporaries of norms, rotary, SwiGLU...; counted like the kernels). Each is written
# once and read about once: 2 x dtype bytes of memory traffic.
ACT_ELEMS_PER_TOKEN_LAYER_FWD = 67
ACT_ELEMS_PER_TOKEN_LAYER_TRAIN = 163
OPT_KERNELS_PER_TENSOR = 11  # torch.optim.AdamW(foreach=False) step + zero_grad
# Interference between local CPU workers that run at once (``interference``: L1/L2
# refilled when they time-slice a core; ``contention``: shared L3 and memory bandwidth
# across cores): per co-running worker, this fraction of a worker's dispatch and
# weight-streaming work at the peak (the least it can cost: efficiency 1); the fitted
# efficiency scales it up.
INTERFERENCE_PER_CORUNNER = 0.1
_COMPUTE = ("gemm", "attention", "mem", "elementwise", "launch")


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


class _Shape:
    """Per-device model quantities for one (tp, pp) layout."""

    __slots__ = ("attn_seq_coef", "flops_tok", "h", "kv_dim_dev", "num_layers_dev", "params_dev")

    def __init__(self, m: ModelSpec, value_head: bool, tp: int, pp: int) -> None:
        h = m.hidden
        self.h = h
        self.num_layers_dev = math.ceil(m.num_layers / pp)
        head = h * (1 if value_head else m.vocab)
        layer_mat = m.layer_params - 2 * h
        # The last pipeline stage holds its layers and the head: the slowest stage.
        self.flops_tok = 2.0 * (self.num_layers_dev * layer_mat + head) / tp
        emb = h * m.vocab
        layers = self.num_layers_dev * m.layer_params
        extra = emb + head if pp == 1 else max(emb, head)
        self.params_dev = (layers + extra) / tp
        # Fewer kv heads than tp ranks: each rank keeps one whole kv head (replicated).
        self.kv_dim_dev = max(m.num_kv_heads / tp, 1.0) * m.head_dim
        self.attn_seq_coef = self.num_layers_dev * 2.0 * h / tp  # x s^2 per sequence


@functools.lru_cache(maxsize=4096)
def _shape(m: ModelSpec, value_head: bool, tp: int, pp: int) -> _Shape:
    # The planner prices ~50 layouts per stage per decision; a _Shape depends only on
    # these frozen inputs, so building it once per layout halves the table build.
    return _Shape(m, value_head, tp, pp)


def _ring(n: int, nbytes: float, bw: float, lat: float) -> float:
    return 2.0 * (n - 1) / n * nbytes / bw + 2.0 * (n - 1) * lat


def stage_work(
    sw: StageWork,
    dp: int,
    tp: int,
    pp: int,
    tiers: tuple[str, str, str],
    cluster: ClusterSpec,
    dtype: str,
) -> np.ndarray:
    """Ideal seconds per operation class (indexed as ``CLASSES``) of one stage layout.

    Arguments:
        sw: the stage's work.
        dp, tp, pp: its layout.
        tiers: link tier (``"intra"``/``"inter"``) of its tp groups, pp chains, dp group.
        cluster: the devices and links.
        dtype: compute dtype.

    Returns:
        A float array of length ``NUM_CLASSES``.
    """
    w = _device_work(sw, dp, tp, pp, tiers, cluster, dtype)
    if isinstance(cluster, LocalCpuClusterSpec) and sw.kind != "rule":
        _share_cores(w, dp * tp * pp, cluster)
    return w


_COMPUTE_IDX = [CLASS_INDEX[c] for c in _COMPUTE]


def _share_cores(w: np.ndarray, busy: int, cluster: LocalCpuClusterSpec) -> None:
    """Local CPU workers: the stage's own busy workers set its share of the cores."""
    busy = min(busy, cluster.num_devices)
    if not cluster.capped:  # capped: a worker's own cores, whatever its peers do
        nominal = min(1.0, cluster.cores / cluster.num_devices)  # what the device spec holds
        w[_COMPUTE_IDX] *= nominal / min(1.0, cluster.cores / busy)
    if busy > 1:
        # Workers that run at the same instant (one per core) contend for the shared L3
        # and memory bandwidth; the rest time-slice a core with another and refill its
        # L1/L2 after each switch. Two mechanisms, fitted apart; the same start.
        at_once = min(busy, max(cluster.cores, 1.0))
        base = w[CLASS_INDEX["launch"]] + w[CLASS_INDEX["mem"]]
        w[CLASS_INDEX["interference"]] = (busy - at_once) * INTERFERENCE_PER_CORUNNER * base
        w[CLASS_INDEX["contention"]] = (at_once - 1) * INTERFERENCE_PER_CORUNNER * base


def _device_work(
    sw: StageWork,
    dp: int,
    tp: int,
    pp: int,
    tiers: tuple[str, str, str],
    cluster: ClusterSpec,
    dtype: str,
) -> np.ndarray:
    w = np.zeros(NUM_CLASSES)
    if sw.kind == "rule":
        return w
    m = sw.model_spec
    dev = cluster.device
    peak, bw, ovh = dev.peak(dtype), dev.mem_bw_Bps, dev.kernel_overhead_s
    links = {"intra": cluster.intra, "inter": cluster.inter}
    ttp, tpp, tdp = (links[t] for t in tiers)
    ab = dtype_bytes(dtype)
    sh = _shape(m, sw.value_head, tp, pp)
    b = math.ceil(sw.num_samples / dp)
    g, ar_t, p2p_t = CLASS_INDEX, "allreduce:" + tiers[0], "p2p:" + tiers[1]

    if sw.kind in ("train", "forward"):
        s = sw.seq_len
        mb = min(sw.micro_batch, b)
        nmb = math.ceil(b / mb)
        slots = nmb + pp - 1
        mult = 3.0 if sw.kind == "train" else 1.0
        reps = sw.epochs if sw.kind == "train" else 1
        ars = 4 if sw.kind == "train" else 2
        w[g["gemm"]] = reps * slots * mult * mb * s * sh.flops_tok / peak
        w[g["attention"]] = reps * slots * mult * mb * s * s * sh.attn_seq_coef / peak
        kernels = KERNELS_PER_LAYER_FWD * sh.num_layers_dev + KERNELS_HEAD_FWD
        if sw.kind == "train":
            kernels += KERNELS_PER_LAYER_BWD * sh.num_layers_dev + KERNELS_HEAD_BWD
        w[g["launch"]] = reps * slots * kernels * ovh
        if tp > 1:
            one = _ring(tp, mb * s * sh.h * ab, ttp.bandwidth_Bps, ttp.latency_s)
            w[g[ar_t]] += reps * slots * sh.num_layers_dev * ars * one
        if pp > 1:
            per = (mb * s * sh.h * ab) / tpp.bandwidth_Bps + tpp.latency_s
            w[g[p2p_t]] += reps * slots * (2 if sw.kind == "train" else 1) * per
        passes = WEIGHT_PASSES_TRAIN if sw.kind == "train" else WEIGHT_PASSES_FWD
        act = (
            ACT_ELEMS_PER_TOKEN_LAYER_TRAIN if sw.kind == "train" else ACT_ELEMS_PER_TOKEN_LAYER_FWD
        )
        # Roofline per GEMM call: a micro-batch of few tokens still streams all weights,
        # so GEMM efficiency saturates with micro-batch size (rows) as tokens/(tokens+k).
        w[g["mem"]] = reps * slots * passes * sh.params_dev * ab / bw
        act_bytes = 2.0 * act * mb * s * sh.h / tp * sh.num_layers_dev * ab
        w[g["elementwise"]] = reps * slots * act_bytes / bw
        if sw.kind == "train":
            w[g["mem"]] += reps * 2.0 * TRAIN_STATE_BYTES_PER_PARAM * sh.params_dev / bw
            # A non-fused optimizer step and zero_grad launch kernels per parameter tensor.
            tensors = TENSORS_PER_LAYER * sh.num_layers_dev + 3
            w[g["launch"]] += reps * OPT_KERNELS_PER_TENSOR * tensors * ovh
            if dp > 1:
                one = _ring(dp, sh.params_dev * ab, tdp.bandwidth_Bps, tdp.latency_s)
                w[g["allreduce:" + tiers[2]]] += reps * one
        return w

    assert sw.kind == "generate", sw.kind
    p, r = sw.prompt_len, sw.response_len
    ngrp = min(b, pp)
    slots = ngrp + pp - 1
    bg = b / ngrp
    # Prefill of the prompts.
    w[g["gemm"]] += slots * bg * p * sh.flops_tok / peak
    w[g["attention"]] += slots * bg * p * p * sh.attn_seq_coef / peak
    w[g["launch"]] += slots * (KERNELS_PER_LAYER_FWD * sh.num_layers_dev + KERNELS_HEAD_FWD) * ovh
    w[g["mem"]] += slots * WEIGHT_PASSES_FWD * sh.params_dev * ab / bw
    act_tok = 2.0 * ACT_ELEMS_PER_TOKEN_LAYER_FWD * sh.h / tp * sh.num_layers_dev * ab / bw
    w[g["elementwise"]] += slots * bg * p * act_tok
    if tp > 1:
        one = _ring(tp, bg * p * sh.h * ab, ttp.bandwidth_Bps, ttp.latency_s)
        w[g[ar_t]] += slots * sh.num_layers_dev * 2 * one
    if pp > 1:
        w[g[p2p_t]] += slots * ((bg * p * sh.h * ab) / tpp.bandwidth_Bps + tpp.latency_s)
    if r > 0:
        ctx = p + r / 2.0  # mean context over the decode steps
        kv_bytes = bg * ctx * 2 * sh.num_layers_dev * sh.kv_dim_dev * ab
        w[g["gemm"]] += r * slots * bg * sh.flops_tok / peak
        w[g["attention"]] += r * slots * bg * 2.0 * ctx * sh.attn_seq_coef / peak
        w[g["mem"]] += r * slots * (sh.params_dev * ab + kv_bytes) / bw
        decode = KERNELS_PER_LAYER_DECODE * sh.num_layers_dev + KERNELS_HEAD_DECODE
        w[g["launch"]] += r * slots * decode * ovh
        w[g["elementwise"]] += r * slots * bg * act_tok
        if tp > 1:
            one = _ring(tp, bg * sh.h * ab, ttp.bandwidth_Bps, ttp.latency_s)
            w[g[ar_t]] += r * slots * sh.num_layers_dev * 2 * one
        if pp > 1:
            w[g[p2p_t]] += r * slots * ((bg * sh.h * ab) / tpp.bandwidth_Bps + tpp.latency_s)
    return w


def sync_work(
    actor: ModelSpec, tp: int, pp: int, tier: str, cluster: ClusterSpec, dtype: str
) -> np.ndarray:
    """Ideal seconds of the per-step weight sync into one rollout device.

    Each rollout device receives its shard of the actor's weights (the bytes it holds
    in the rollout layout) from the training layout, whatever that layout is: the
    receive side is the bottleneck of an all-gather/broadcast-style reshard.
    """
    w = np.zeros(NUM_CLASSES)
    link = cluster.intra if tier == "intra" else cluster.inter
    sh = _shape(actor, False, tp, pp)
    w[CLASS_INDEX["allgather:" + tier]] = (
        sh.params_dev * dtype_bytes(dtype) / link.bandwidth_Bps + link.latency_s
    )
    return w


def stage_memory(sw: StageWork, dp: int, tp: int, pp: int, dtype: str) -> int:
    """Peak bytes on each device of the stage for layout (dp, tp, pp)."""
    if sw.kind == "rule":
        return 0
    m = sw.model_spec
    ab = dtype_bytes(dtype)
    sh = _shape(m, sw.value_head, tp, pp)
    vout = 1 if sw.value_head else m.vocab
    b = math.ceil(sw.num_samples / dp)
    h = m.hidden
    if sw.kind == "train":
        s = sw.seq_len
        mb = min(sw.micro_batch, b)
        nmb = math.ceil(b / mb)
        per_layer = s * mb * h * (10 + 24 / tp) * ab / 2
        act = sh.num_layers_dev * min(nmb, pp) * per_layer
        logits = 8.0 * mb * s * vout / tp
        return int(TRAIN_STATE_BYTES_PER_PARAM * sh.params_dev + act + logits)
    if sw.kind == "forward":
        s = sw.seq_len
        mb = min(sw.micro_batch, b)
        act = s * mb * h * (10 + 24 / tp) * ab / 2
        return int(ab * sh.params_dev + act + 4.0 * mb * s * vout / tp)
    assert sw.kind == "generate", sw.kind
    kv = b * sw.seq_len * 2 * sh.num_layers_dev * sh.kv_dim_dev * ab
    return int(ab * sh.params_dev + kv + 4.0 * b * vout / tp)


def state_bytes(model: ModelSpec, trains: bool, tp: int, pp: int, dtype: str) -> float:
    """Bytes of one unit's state held per device (what a copy must move)."""
    sh = _shape(model, False, tp, pp)
    per_param = (TRAIN_STATE_BYTES_PER_PARAM - 2) if trains else dtype_bytes(dtype)
    # Gradients (2 of the 16 bytes) are rebuilt by the next backward; not moved.
    return per_param * sh.params_dev
