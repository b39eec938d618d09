"""Stage tables of the exact planner (see ``nereus_rl.planner.planner``): the layouts of a stage,
its work matrix and memory per layout, and the set partitions of the stages.
"""

from __future__ import annotations

import functools

import numpy as np

from nereus_rl.core.spec import ClusterSpec
from nereus_rl.core.workload import StageWork
from nereus_rl.costmodel.vec import stage_memory_many, stage_work_many
from nereus_rl.costmodel.work import sync_work


def _layouts(max_d: int, sw: StageWork) -> tuple[tuple[int, int, int], ...]:
    m = sw.model_spec
    return _layouts_of(
        max_d, m.num_heads, m.num_layers, m.num_kv_heads, replicate_kv=sw.kind == "generate"
    )


def tp_allowed(tp: int, num_heads: int, num_kv_heads: int, replicate_kv: bool) -> bool:
    """Whether tensor parallelism of degree ``tp`` splits the attention cleanly.

    The rule real tensor-parallel implementations apply: the query heads split evenly
    (``num_heads % tp == 0``), and so do the key/value heads (GQA query groups): Megatron
    requires ``num_query_groups % tp == 0``, which the training and forward stages follow.
    A generation engine (vLLM) also accepts ``tp`` a multiple of the KV heads, each rank
    then keeping one whole KV head (replicated, as the cost model prices it:
    ``costmodel_work._Shape.kv_dim_dev``); ``replicate_kv`` allows that for the rollout.
    """
    if num_heads % tp:
        return False
    return num_kv_heads % tp == 0 or (replicate_kv and tp % num_kv_heads == 0)


@functools.lru_cache(maxsize=64)
def _layouts_of(
    max_d: int,
    num_heads: int,
    num_layers: int,
    num_kv_heads: int | None = None,
    replicate_kv: bool = True,
) -> tuple[tuple[int, int, int], ...]:
    """Every (dp, tp, pp) of powers of two with ``dp * tp * pp <= max_d``, ``pp`` at most
    the layers and ``tp`` allowed by :func:`tp_allowed` (``num_kv_heads`` None: MHA)."""
    kv = num_heads if num_kv_heads is None else num_kv_heads
    out = []
    d = 1
    while d <= max_d:
        tp = 1
        while tp <= d and tp <= num_heads:
            if tp_allowed(tp, num_heads, kv, replicate_kv):
                pp = 1
                while tp * pp <= d and pp <= num_layers:
                    out.append((d // (tp * pp), tp, pp))
                    pp *= 2
            tp *= 2
        d *= 2
    return tuple(out)


def tp_rule(sw: StageWork, max_d: int) -> str | None:
    """A sentence naming the tp degrees the head rule leaves ``sw`` (None when it removes
    none up to ``max_d`` devices), for error messages."""
    m = sw.model_spec
    rep = sw.kind == "generate"
    cut, ok = False, []
    tp = 1
    while tp <= min(max_d, m.num_heads):
        if tp_allowed(tp, m.num_heads, m.num_kv_heads, rep):
            ok.append(tp)
        else:
            cut = True
        tp *= 2
    if not cut:
        return None
    rule = "num_kv_heads % tp == 0 or tp % num_kv_heads == 0" if rep else "num_kv_heads % tp == 0"
    return (
        f"{sw.stage} may use tp in {ok} only ({m.name}: {m.num_heads} heads, "
        f"{m.num_kv_heads} KV heads; tp must divide the heads and {rule})"
    )


@functools.lru_cache(maxsize=64)
def _layout_arrays(layouts: tuple, dpn: int, one_node: bool) -> tuple:
    """dp, tp, pp, devices and the inter-node flags (tp groups, pp chains, dp group) of
    each layout, as arrays (shared by every bucket's table of the same stage shape)."""
    a = np.array(layouts, dtype=np.int64).reshape(-1, 3)
    dp, tp, pp = a[:, 0], a[:, 1], a[:, 2]
    d = dp * tp * pp
    inter = np.stack([tp > dpn, tp * pp > dpn, d > dpn], axis=1) & (not one_node)
    out = (dp, tp, pp, d, inter)
    for arr in out:
        arr.setflags(write=False)  # cached: shared by tables
    return out


@functools.lru_cache(maxsize=8)
def _partitions(num: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple(tuple(p) for p in set_partitions(list(range(num))))


def set_partitions(items: list[int]) -> list[list[tuple[int, ...]]]:
    """All set partitions of ``items`` (each a list of groups, groups as tuples)."""
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for part in set_partitions(rest):
        out.append([(first,), *part])
        for i in range(len(part)):
            out.append([*part[:i], (first, *part[i]), *part[i + 1 :]])
    return out


class _StageTable:
    """Layouts, work matrix and memory of one stage shape (both sync variants for rollout)."""

    def __init__(
        self, sw: StageWork, actor, cluster: ClusterSpec, max_d: int, dtype: str, sync_cache: dict
    ):
        self.layouts = _layouts(max_d, sw)
        dp, tp, pp, d_arr, inter = _layout_arrays(
            self.layouts, cluster.devices_per_node, cluster.num_nodes == 1
        )
        # The whole table priced at once, bitwise equal to stage_work/stage_memory per
        # layout (costmodel_vec): this was 95-98 % of a call that met a new bucket.
        self.W = stage_work_many(sw, dp, tp, pp, inter, cluster, dtype)
        self.mem = stage_memory_many(sw, dp, tp, pp, dtype)
        self.d = d_arr
        self.mem_list = self.mem.tolist()
        d = d_arr.tolist()
        self.by_d: dict[int, list[int]] = {}
        for i, di in enumerate(d):
            self.by_d.setdefault(di, []).append(i)
        self.sync = {}
        self._work: dict = {}  # variant -> W + sync[variant]
        if sw.stage == "rollout" and actor is not None:
            # The weight sync does not depend on lengths: shared by every bucket's table.
            sk = (actor, sw.model_spec, max_d, dtype)
            got = sync_cache.get(sk)
            if got is None:
                got = sync_cache[sk] = {
                    t: np.array(
                        [sync_work(actor, tp, pp, t, cluster, dtype) for _, tp, pp in self.layouts]
                    )
                    for t in ("intra", "inter")
                }
            self.sync = got

    def work(self, variant: str | None) -> np.ndarray:
        """The work matrix, with the weight sync of ``variant`` added for the rollout (kept:
        the sum does not depend on the efficiencies)."""
        if variant is None:
            return self.W
        got = self._work.get(variant)
        if got is None:
            got = self._work[variant] = self.W + self.sync[variant]
        return got
