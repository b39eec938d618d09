"""A whole stage table priced at once: ``costmodel_work.stage_work`` and ``stage_memory``
over arrays of layouts, bit for bit.

The planner prices ~50 layouts per stage whenever it meets a new response-length
bucket; one scalar call per layout made that 95-98 % of such a call. Here every
expression of the scalar code is evaluated on float64/int64 arrays with the same
operands in the same order: IEEE element-wise operations round exactly like Python
floats when the association is the same (and ints below 2**53 convert exactly), so
the results are identical, not merely close. ``tests/rl/costmodel/test_costmodel_vec.py`` checks
that with ``np.array_equal``; any change to the scalar code must be mirrored here.
"""

from __future__ import annotations

import functools

import numpy as np

from nereus_rl.core.spec import ClusterSpec, LocalCpuClusterSpec, ModelSpec
from nereus_rl.core.workload import StageWork
from nereus_rl.costmodel.work import (
    _COMPUTE_IDX,
    ACT_ELEMS_PER_TOKEN_LAYER_FWD,
    ACT_ELEMS_PER_TOKEN_LAYER_TRAIN,
    CLASS_INDEX,
    INTERFERENCE_PER_CORUNNER,
    KERNELS_HEAD_BWD,
    KERNELS_HEAD_DECODE,
    KERNELS_HEAD_FWD,
    KERNELS_PER_LAYER_BWD,
    KERNELS_PER_LAYER_DECODE,
    KERNELS_PER_LAYER_FWD,
    NUM_CLASSES,
    OPT_KERNELS_PER_TENSOR,
    TENSORS_PER_LAYER,
    TRAIN_STATE_BYTES_PER_PARAM,
    WEIGHT_PASSES_FWD,
    WEIGHT_PASSES_TRAIN,
    _shape,
    dtype_bytes,
)


class _Shapes:
    """``_Shape``'s fields gathered over a tuple of layouts (arrays, one entry per layout)."""

    def __init__(self, m: ModelSpec, value_head: bool, tps: tuple, pps: tuple) -> None:
        # Gathered from the scalar ``_shape`` itself so the two cannot drift apart.
        shs = [_shape(m, value_head, tp, pp) for tp, pp in zip(tps, pps)]
        self.h = m.hidden
        self.num_layers_dev = np.array([s.num_layers_dev for s in shs], dtype=np.int64)
        self.flops_tok = np.array([s.flops_tok for s in shs], dtype=np.float64)
        self.params_dev = np.array([s.params_dev for s in shs], dtype=np.float64)
        self.kv_dim_dev = np.array([s.kv_dim_dev for s in shs], dtype=np.float64)
        self.attn_seq_coef = np.array([s.attn_seq_coef for s in shs], dtype=np.float64)


@functools.lru_cache(maxsize=256)
def _shapes(m: ModelSpec, value_head: bool, tps: tuple, pps: tuple) -> _Shapes:
    return _Shapes(m, value_head, tps, pps)


def _as_i64(name: str, v) -> np.ndarray:
    if type(v) is np.ndarray and v.dtype == np.int64 and v.ndim == 1:
        return v  # the planner's own arrays: skip the checks (they cost ~10 % of a table)
    a = np.asarray(v)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-d integer array (one entry per layout), got {a!r}")
    return a.astype(np.int64)


def _ring(n, nbytes, bw, lat):
    # Same expression as costmodel_work._ring, on arrays.
    return 2.0 * (n - 1) / n * nbytes / bw + 2.0 * (n - 1) * lat


def stage_work_many(
    sw: StageWork,
    dp,
    tp,
    pp,
    inter,
    cluster: ClusterSpec,
    dtype: str,
) -> np.ndarray:
    """``costmodel_work.stage_work`` of every layout ``(dp[i], tp[i], pp[i])`` at once.

    Arguments:
        sw: the stage's work.
        dp, tp, pp: 1-d integer arrays, one entry per layout.
        inter: bool array of shape ``(layouts, 3)``: whether the layout's tp groups, pp
            chains and dp group cross nodes (the ``tiers`` of the scalar call, ``True``
            for ``"inter"``).
        cluster: the devices and links.
        dtype: compute dtype.

    Returns:
        A float64 array ``(layouts, NUM_CLASSES)``, row ``i`` equal (bitwise) to
        ``stage_work(sw, dp[i], tp[i], pp[i], tiers[i], cluster, dtype)``.

    Raises:
        ValueError: arrays of different lengths or a non-integer layout array.
    """
    dp, tp, pp = _as_i64("dp", dp), _as_i64("tp", tp), _as_i64("pp", pp)
    inter = np.asarray(inter, dtype=bool)
    n = len(dp)
    if len(tp) != n or len(pp) != n or inter.shape != (n, 3):
        raise ValueError(
            f"dp, tp, pp must have one entry per layout and inter shape (layouts, 3); got "
            f"{len(dp)}, {len(tp)}, {len(pp)} and {inter.shape}"
        )
    w = _device_work_many(sw, dp, tp, pp, inter, cluster, dtype)
    if isinstance(cluster, LocalCpuClusterSpec) and sw.kind != "rule":
        _share_cores_many(w, dp * tp * pp, cluster)
    return w


def _share_cores_many(w: np.ndarray, busy: np.ndarray, cluster: LocalCpuClusterSpec) -> None:
    busy = np.minimum(busy, cluster.num_devices)
    nominal = min(1.0, cluster.cores / cluster.num_devices)
    factor = nominal / np.minimum(1.0, cluster.cores / busy)
    w[:, _COMPUTE_IDX] *= factor[:, None]
    many = busy > 1
    il, im = CLASS_INDEX["launch"], CLASS_INDEX["mem"]
    # As costmodel_work._share_cores, operation for operation (bitwise equal).
    at_once = np.minimum(busy[many], max(cluster.cores, 1.0))
    base = w[many, il] + w[many, im]
    w[many, CLASS_INDEX["interference"]] = (busy[many] - at_once) * INTERFERENCE_PER_CORUNNER * base
    w[many, CLASS_INDEX["contention"]] = (at_once - 1) * INTERFERENCE_PER_CORUNNER * base


def _add(w: np.ndarray, mask: np.ndarray, cols: np.ndarray, val: np.ndarray) -> None:
    """``w[i, cols[i]] += val[i]`` where ``mask[i]`` (the scalar code's ``if``)."""
    rows = np.nonzero(mask)[0]
    w[rows, cols[rows]] += val[rows]


def _device_work_many(sw, dp, tp, pp, inter, cluster, dtype) -> np.ndarray:
    n = len(dp)
    w = np.zeros((n, NUM_CLASSES))
    if sw.kind == "rule":
        return w
    m = sw.model_spec
    dev = cluster.device
    peak, bw, ovh = dev.peak(dtype), dev.mem_bw_Bps, dev.kernel_overhead_s
    lo, hi = cluster.intra, cluster.inter
    bws = np.where(inter, hi.bandwidth_Bps, lo.bandwidth_Bps)
    lats = np.where(inter, hi.latency_s, lo.latency_s)
    ttp_bw, tpp_bw, tdp_bw = bws[:, 0], bws[:, 1], bws[:, 2]
    ttp_lat, tpp_lat, tdp_lat = lats[:, 0], lats[:, 1], lats[:, 2]
    ar_cols = np.where(inter, CLASS_INDEX["allreduce:inter"], CLASS_INDEX["allreduce:intra"])
    p2p_cols = np.where(inter[:, 1], CLASS_INDEX["p2p:inter"], CLASS_INDEX["p2p:intra"])
    ab = dtype_bytes(dtype)
    sh = _shapes(m, sw.value_head, tuple(tp.tolist()), tuple(pp.tolist()))
    nl, h = sh.num_layers_dev, sh.h
    b = np.ceil(sw.num_samples / dp).astype(np.int64)
    g = CLASS_INDEX

    if sw.kind in ("train", "forward"):
        s = sw.seq_len
        mb = np.minimum(sw.micro_batch, b)
        nmb = np.ceil(b / mb).astype(np.int64)
        slots = nmb + pp - 1
        mult = 3.0 if sw.kind == "train" else 1.0
        reps = sw.epochs if sw.kind == "train" else 1
        ars = 4 if sw.kind == "train" else 2
        w[:, g["gemm"]] = reps * slots * mult * mb * s * sh.flops_tok / peak
        w[:, g["attention"]] = reps * slots * mult * mb * s * s * sh.attn_seq_coef / peak
        kernels = KERNELS_PER_LAYER_FWD * nl + KERNELS_HEAD_FWD
        if sw.kind == "train":
            kernels += KERNELS_PER_LAYER_BWD * nl + KERNELS_HEAD_BWD
        w[:, g["launch"]] = reps * slots * kernels * ovh
        one = _ring(tp, mb * s * h * ab, ttp_bw, ttp_lat)
        _add(w, tp > 1, ar_cols[:, 0], reps * slots * nl * ars * one)
        per = (mb * s * h * ab) / tpp_bw + tpp_lat
        _add(w, pp > 1, p2p_cols, reps * slots * (2 if sw.kind == "train" else 1) * per)
        passes = WEIGHT_PASSES_TRAIN if sw.kind == "train" else WEIGHT_PASSES_FWD
        act = (
            ACT_ELEMS_PER_TOKEN_LAYER_TRAIN if sw.kind == "train" else ACT_ELEMS_PER_TOKEN_LAYER_FWD
        )
        w[:, g["mem"]] = reps * slots * passes * sh.params_dev * ab / bw
        act_bytes = 2.0 * act * mb * s * h / tp * nl * ab
        w[:, g["elementwise"]] = reps * slots * act_bytes / bw
        if sw.kind == "train":
            w[:, g["mem"]] += reps * 2.0 * TRAIN_STATE_BYTES_PER_PARAM * sh.params_dev / bw
            tensors = TENSORS_PER_LAYER * nl + 3
            w[:, g["launch"]] += reps * OPT_KERNELS_PER_TENSOR * tensors * ovh
            one = _ring(dp, sh.params_dev * ab, tdp_bw, tdp_lat)
            _add(w, dp > 1, ar_cols[:, 2], reps * one)
        return w

    assert sw.kind == "generate", sw.kind
    p, r = sw.prompt_len, sw.response_len
    ngrp = np.minimum(b, pp)
    slots = ngrp + pp - 1
    bg = b / ngrp
    w[:, g["gemm"]] += slots * bg * p * sh.flops_tok / peak
    w[:, g["attention"]] += slots * bg * p * p * sh.attn_seq_coef / peak
    w[:, g["launch"]] += slots * (KERNELS_PER_LAYER_FWD * nl + KERNELS_HEAD_FWD) * ovh
    w[:, g["mem"]] += slots * WEIGHT_PASSES_FWD * sh.params_dev * ab / bw
    act_tok = 2.0 * ACT_ELEMS_PER_TOKEN_LAYER_FWD * h / tp * nl * ab / bw
    w[:, g["elementwise"]] += slots * bg * p * act_tok
    one = _ring(tp, bg * p * h * ab, ttp_bw, ttp_lat)
    _add(w, tp > 1, ar_cols[:, 0], slots * nl * 2 * one)
    _add(w, pp > 1, p2p_cols, slots * ((bg * p * h * ab) / tpp_bw + tpp_lat))
    if r > 0:
        ctx = p + r / 2.0
        kv_bytes = bg * ctx * 2 * nl * sh.kv_dim_dev * ab
        w[:, g["gemm"]] += r * slots * bg * sh.flops_tok / peak
        w[:, g["attention"]] += r * slots * bg * 2.0 * ctx * sh.attn_seq_coef / peak
        w[:, g["mem"]] += r * slots * (sh.params_dev * ab + kv_bytes) / bw
        decode = KERNELS_PER_LAYER_DECODE * nl + KERNELS_HEAD_DECODE
        w[:, g["launch"]] += r * slots * decode * ovh
        w[:, g["elementwise"]] += r * slots * bg * act_tok
        one = _ring(tp, bg * h * ab, ttp_bw, ttp_lat)
        _add(w, tp > 1, ar_cols[:, 0], r * slots * nl * 2 * one)
        _add(w, pp > 1, p2p_cols, r * slots * ((bg * h * ab) / tpp_bw + tpp_lat))
    return w


def stage_memory_many(sw: StageWork, dp, tp, pp, dtype: str) -> np.ndarray:
    """``costmodel_work.stage_memory`` of every layout at once (int64 bytes per device).

    Raises:
        ValueError: arrays of different lengths or a non-integer layout array.
    """
    dp, tp, pp = _as_i64("dp", dp), _as_i64("tp", tp), _as_i64("pp", pp)
    if not len(dp) == len(tp) == len(pp):
        raise ValueError(f"dp, tp, pp lengths differ: {len(dp)}, {len(tp)}, {len(pp)}")
    if sw.kind == "rule":
        return np.zeros(len(dp), dtype=np.int64)
    m = sw.model_spec
    ab = dtype_bytes(dtype)
    sh = _shapes(m, sw.value_head, tuple(tp.tolist()), tuple(pp.tolist()))
    nl = sh.num_layers_dev
    vout = 1 if sw.value_head else m.vocab
    b = np.ceil(sw.num_samples / dp).astype(np.int64)
    h = m.hidden
    # astype(int64) truncates toward zero like int(); every value is positive.
    if sw.kind == "train":
        s = sw.seq_len
        mb = np.minimum(sw.micro_batch, b)
        nmb = np.ceil(b / mb).astype(np.int64)
        per_layer = s * mb * h * (10 + 24 / tp) * ab / 2
        act = nl * np.minimum(nmb, pp) * per_layer
        logits = 8.0 * mb * s * vout / tp
        return (TRAIN_STATE_BYTES_PER_PARAM * sh.params_dev + act + logits).astype(np.int64)
    if sw.kind == "forward":
        s = sw.seq_len
        mb = np.minimum(sw.micro_batch, b)
        act = s * mb * h * (10 + 24 / tp) * ab / 2
        return (ab * sh.params_dev + act + 4.0 * mb * s * vout / tp).astype(np.int64)
    assert sw.kind == "generate", sw.kind
    kv = b * sw.seq_len * 2 * nl * sh.kv_dim_dev * ab
    return (ab * sh.params_dev + kv + 4.0 * b * vout / tp).astype(np.int64)
