"""A short pure-Python reference of the shard-remap planner: clear over fast.

It walks rank pairs and boxes directly (no shard classes) and applies the same
source-choice rules as csrc/remap, so its plan must equal the C++ plan:

1. For every destination rank and tensor, cut the rank's box along the split
   dim at the source's tp chunk boundaries; the holders of a segment are the
   source ranks whose box contains it. A segment the rank holds itself is a
   local copy. Otherwise it joins the rank's block for that holder set.
2. Holder sets are visited smallest first (ties: sorted holder lists). With
   n needers and h holders each block is cut into k = min(max(1, h // n),
   items) parts of about equal bytes (cut after the first item where the
   running bytes reach j/k of the block).
3. Parts whose receiver has a holder on its node first, then largest first
   (then by destination position, then part index), go
   to the least-loaded holder (lowest position on ties), unless a holder that
   can take the part without exceeding the cap max(the group's highest load,
   lowest load + part bytes, the holders' mean load once the group is placed)
   already sends to the receiver (allowed 64 KiB more: what a message costs),
   or else is on the receiver's node: then to the least-loaded such holder.
"""

from __future__ import annotations

import itertools

from nereus_comm.errors import PlanError
from nereus_comm.layout import Layout, TensorSpec, chunk_range, infer_num_layers

MSG = 64 << 10  # kMessageCostBytes: slack for a holder already sending to the receiver
Item = tuple[int, int, int]  # (tensor, start, stop) along the split axis


def _axis(spec: TensorSpec, layout: Layout, rank: int, num_layers: int):
    """The rank's (start, stop) along the split axis (replicated: (0, 1)), or None."""
    box = layout.box(spec, rank, num_layers)
    if box is None:
        return None
    return box[spec.split_dim] if spec.split_dim is not None else (0, 1)


def _unit(spec: TensorSpec) -> int:
    if spec.split_dim is None:
        return spec.nbytes
    n = spec.shape[spec.split_dim]
    return spec.nbytes // n if n else 0


def reference_plan(
    specs: list[TensorSpec], src: Layout, dst: Layout, num_layers: int | None = None
) -> dict:
    """Plan like nereus_comm.plan.plan_reshard, slowly.

    Returns:
        {"local": {dst_rank: sorted [items]}, "messages": {(src_rank, dst_rank):
        sorted [items]}, "send": {src_rank: bytes}, "recv": {dst_rank: bytes},
        "local_bytes": int, "lower_bound_bytes": int}. Items are (tensor, start,
        stop) along the split axis ((0, 1) for replicated tensors).
    """
    inferred = infer_num_layers(specs)
    ls = src.num_layers or num_layers or inferred
    ld = dst.num_layers or num_layers or inferred
    units = [_unit(s) for s in specs]

    local: dict[int, list[Item]] = {}
    blocks: dict[tuple[int, ...], dict[int, list[Item]]] = {}  # holders -> dst pos -> items
    needed = 0
    for r in dst.ranks:
        for i, spec in enumerate(specs):
            want = _axis(spec, dst, r, ld)
            if want is None or want[0] >= want[1] or units[i] == 0:
                continue
            needed += (want[1] - want[0]) * units[i]
            a, b = want
            cuts = {a, b}
            if spec.split_dim is not None:
                n = spec.shape[spec.split_dim]
                starts = (chunk_range(n, src.tp, t)[0] for t in range(src.tp))
                cuts |= {c for c in starts if a < c < b}
            cuts = sorted(cuts)
            for s0, s1 in itertools.pairwise(cuts):
                holders = []
                for q in src.ranks:
                    have = _axis(spec, src, q, ls)
                    if have is not None and have[0] <= s0 and s1 <= have[1]:
                        holders.append(q)
                if not holders:
                    raise PlanError(f"no source holds {spec!r}")
                if r in holders:
                    local.setdefault(r, []).append((i, s0, s1))
                else:
                    key = tuple(sorted(src.position(q) for q in holders))
                    blocks.setdefault(key, {}).setdefault(dst.position(r), []).append((i, s0, s1))

    def src_node(s: int) -> int:
        return src.node_of[s] if src.node_of else 0

    def dst_node(r: int) -> int:
        return dst.node_of[r] if dst.node_of else 0

    def nbytes(items: list[Item]) -> int:
        return sum((b - a) * units[t] for t, a, b in items)

    load = [0] * src.world_size
    messages: dict[tuple[int, int], list[Item]] = {}
    peers: dict[int, set[int]] = {}  # dst position -> source positions chosen so far
    for holders in sorted(blocks, key=lambda h: (len(h), h)):
        need = blocks[holders]
        k = max(1, len(holders) // len(need))
        parts = []
        for r, items in need.items():
            total, kr = nbytes(items), min(k, len(items))
            prefix = [0]
            for item in items:
                prefix.append(prefix[-1] + nbytes([item]))
            start = 0
            for j in range(kr):
                end = len(items)
                if j + 1 < kr:
                    end = next(i for i, p in enumerate(prefix) if p * kr >= total * (j + 1))
                parts.append((items[start:end], r, j))
                start = max(start, end)
        parts = [p for p in parts if p[0]]
        holder_nodes = {src_node(h) for h in holders}
        total = sum(load[h] for h in holders) + sum(nbytes(p[0]) for p in parts)
        mean = -(-total // len(holders))  # mean final load of the holders, rounded up
        parts.sort(key=lambda p: (dst_node(p[1]) not in holder_nodes, -nbytes(p[0]), p[1], p[2]))
        before = max(load[h] for h in holders)
        for items, r, _ in parts:
            u = nbytes(items)
            s = min(holders, key=lambda h: (load[h], h))
            cap = max(max(load[h] for h in holders), load[s] + u, mean)
            fits = [h for h in holders if load[h] + u <= cap]
            mine = [h for h in holders if h in peers.get(r, ()) and load[h] + u <= cap + MSG]
            on_node = [h for h in fits if src_node(h) == dst_node(r)]
            if mine or on_node:
                s = min(mine or on_node, key=lambda h: (load[h], h))
            peers.setdefault(r, set()).add(s)
            load[s] += u
            messages.setdefault((src.ranks[s], dst.ranks[r]), []).extend(items)
        biggest = max((nbytes(p[0]) for p in parts), default=0)
        assert max(load[h] for h in holders) <= max(before, mean + biggest) + MSG

    local_bytes = sum(nbytes(v) for v in local.values())
    return {
        "local": {r: sorted(v) for r, v in local.items()},
        "messages": {k: sorted(v) for k, v in messages.items()},
        "send": {src.ranks[s]: b for s, b in enumerate(load) if b},
        "recv": {
            r: sum(nbytes(v) for (_, d), v in messages.items() if d == r)
            for r in {d for _, d in messages}
        },
        "local_bytes": local_bytes,
        "lower_bound_bytes": needed - local_bytes,
    }
